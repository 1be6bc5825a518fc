"""Bagua's ``bagua.torch_api.contrib.fuse``: the fused optimizer's module (:mod:`.optimizer`)."""
