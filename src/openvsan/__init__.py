"""openvsan: an open-source virtual SAN."""

__version__ = "0.1.0"
