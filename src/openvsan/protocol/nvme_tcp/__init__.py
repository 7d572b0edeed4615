"""NVMe/TCP transport (NVMe/TCP Transport Specification 1.0), sans-IO: PDUs, framing, the queue machine."""
