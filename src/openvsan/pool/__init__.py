"""Storage pools: RAID levels over member block devices, and their parity kernels (pool/parity)."""
