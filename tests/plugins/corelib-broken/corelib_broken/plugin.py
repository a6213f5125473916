"""Fails at import, as a plugin whose native runtime is missing would."""

raise ImportError("libbrokenaccel.so: cannot open shared object file")
