"""Cluster state kept in etcd: the etcd StateStore (etcd.py), and later membership, leases and the witness.

A single node needs none of this: its desired state lives in SQLite (node/statestore.py). A cluster keeps its
state and leases in a real etcd server, never in a home-made consensus (docs/DESIGN "Running model").
"""
