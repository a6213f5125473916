"""Integrations of corelib with model runtimes. Each lives in its own module and imports its
runtime lazily, so importing ``corelib.integrations`` costs nothing:

- ``corelib.integrations.hf``: Hugging Face transformers causal LMs (``generate`` and
  ``CorelibLogitsProcessor``).
"""
