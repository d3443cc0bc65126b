"""Starting and restarting simulators: the fork server's supervisor and Ray actors."""
