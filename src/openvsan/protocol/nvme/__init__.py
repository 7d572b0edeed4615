"""The NVMe command set over fabrics (NVMe Base 2.0, NVM Command Set 1.0, NVMe over Fabrics 1.1), sans-IO:
controllers and subsystems that await only BlockDevice."""
