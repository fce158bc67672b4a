"""How the ranks meet: the strategy, its backend and rendezvous store, the launchers Lightning is given
(strategy), and one rank's view of any world size on torch's fake process group (dry_run)."""
