"""What several processes need to work as one: a process's identity and the check that a peer on
this host is gone (``liveness``)."""
