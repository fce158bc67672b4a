"""The words every layer shares: the errors a user can cause, their one line and exit status (errors), and what
goes to the console (console), and a command's start without the garbage collector (startup). Imports nothing of
the project."""
