"""Tests of cluster/: the cluster and Serve configs, the spot watcher, a multi-node Ray cluster on this host."""
