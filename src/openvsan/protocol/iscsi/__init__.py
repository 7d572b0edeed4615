"""iSCSI (RFC 7143), sans-IO: PDU formats, framing with digests, text keys, CHAP, login, command sequencing."""
