"""corelib-template: a corelib sampling backend (see README.md).

Importing this package is cheap: the sampler module, which is where a device runtime would be
imported, loads only when the backend is chosen.
"""

__version__ = "0.1.0"
