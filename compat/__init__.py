"""functional_bagua.compat: legacy stateful APIs (Bagua, torch.distributed.optim) rebuilt on the
functional core. Installed from the repository's ``compat/`` folder as ``functional_bagua.compat``.

Nothing is exported yet; the fused optimizer and the distributed wrappers land in later issues.
"""

__all__: list[str] = []
