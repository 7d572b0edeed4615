"""Synchronous replication of a volume across nodes (issue 12): the replica set's record and its primary's
election in the cluster's StateStore (record.py); the mirror layer, resync and paths come next."""
