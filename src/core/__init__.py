"""The words every layer shares: the errors a user can cause, their one line and exit status (errors), and what
goes to the console (console). Imports nothing of the project."""
