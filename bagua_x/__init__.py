"""bagua_x: communication-efficient data-parallel training for PyTorch and JAX.

``bagua_x.torch`` and ``bagua_x.jax`` are the frontends; import the one you use
(neither is imported here, so each works without the other installed).
"""

__version__ = "0.1.0"
