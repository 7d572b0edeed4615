"""The StateStore suite (statestore_suite.py) against SQLite and a real etcd (the `store` fixture)."""

from statestore_suite import *
