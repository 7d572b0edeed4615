"""The one build step pyproject.toml cannot state without setuptools' experimental ext-modules table: the
encryption layer's sector walk (src/openvsan/volume/_xts_sectors.c), a loop around libcrypto's own AES-XTS calls,
one call per command instead of two ctypes calls per sector from Python (a MiB of 4 KiB sectors: 0.18 ms instead
of 0.5 ms; docs/benchmarks.md, "The encrypted volume's sector walk in C").

No library offers AES-XTS over many data units with each its own tweak (OpenSSL, libgcrypt and nettle take one
per call; the kernel's dm-crypt does, but its AF_ALG interface is not there on these machines), so the loop is
ours and the cipher OpenSSL's. It needs only a C compiler: no Python or OpenSSL headers, no link. Optional: where
it cannot be built, `pip install` goes on and luks2.Xts walks the sectors in Python, with the same bytes
(tests/unit/test_luks2.py). Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("openvsan.volume._xts_sectors", ["src/openvsan/volume/_xts_sectors.c"], optional=True)])
