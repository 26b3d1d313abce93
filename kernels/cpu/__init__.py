"""The CPU backend: C kernels built for the host (``library.py``) and the Python that calls them."""
