"""Local backend: this machine is one node; each replica is a group of rank processes; same controller core."""
