"""A stand-in for the ``flashinfer`` package on machines without a GPU (tests only).

``flashinfer.sampling`` holds torch transcriptions of the FlashInfer 0.7.4 sampling functions
the cuda backend calls, with their real signatures and input checks. Put this folder first on
``PYTHONPATH`` to make a subprocess import it as ``flashinfer``; in-process tests load
``sampling.py`` by path under another name, so the installed package stays importable.
"""

__version__ = "0.7.4+fake"
