"""The names Bagua's ``data_parallel`` modules define beside the engine: the V1_9_0 interface
(each method Bagua leaves unimplemented raises NotImplementedError, ``train`` returns the module),
the autotuner's settings record, tensor declarations and the MoE parameter test."""

from __future__ import annotations

import pytest
import torch

from functional_bagua.compat import BaguaDistributedDataParallel
from functional_bagua.compat.data_parallel import bagua_distributed
from functional_bagua.compat.data_parallel.distributed import (
    DistributedDataParallel_V1_9_0,
    DistributedDataParallel_V1_9_0_Interface,
)


def test_the_wrapper_implements_bagua_interface_and_the_rest_raises():
    assert issubclass(DistributedDataParallel_V1_9_0, DistributedDataParallel_V1_9_0_Interface)
    interface = DistributedDataParallel_V1_9_0_Interface()
    for call in (
        lambda: interface(1),
        lambda: interface.scatter((), {}, [0]),
        lambda: interface.to_kwargs((), {}, 0),
        lambda: interface.gather([], 0),
        lambda: interface.register_comm_hook(None, print),
        lambda: interface.will_sync_module_buffers(),
        lambda: interface.no_sync().__enter__(),
        lambda: interface.join().__enter__(),
    ):
        with pytest.raises(NotImplementedError):
            call()
    assert interface.train(False) is interface and not interface.training


def test_the_settings_record_takes_known_settings_only():
    settings = bagua_distributed.BaguaHyperparameter()
    declaration = bagua_distributed.TensorDeclaration(name="w", num_elements=6, dtype="f32")
    assert settings.update({"bucket_size": 1 << 20, "buckets": [[declaration]], "unknown": 3}) is settings
    assert settings.dict() == {
        "buckets": [[{"name": "w", "num_elements": 6, "dtype": "f32"}]],
        "bucket_size": 1 << 20,
        "is_hierarchical_reduce": False,
    }
    assert bagua_distributed.BaguaHyperparameter().buckets == []  # a fresh list per record


def test_moe_parameters_are_those_marked_expert():
    plain, expert = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    expert.expert = True
    assert not bagua_distributed.is_moe_param(plain) and bagua_distributed.is_moe_param(expert)
    assert bagua_distributed.BaguaDistributedDataParallel is BaguaDistributedDataParallel


def test_the_algorithm_registry_lists_its_names_as_bagua_does():
    from functional_bagua.compat.algorithms import base

    registry = base.GlobalAlgorithmRegistry
    assert isinstance(registry, base._AlgorithmRegistry)
    names = registry.available_algorithms()
    assert "gradient_allreduce" in names and sorted(names) == registry.names()
    assert str(registry) == "Registered Algorithms: " + ", ".join(names)


def test_version_is_the_torch_version_as_in_bagua():
    import functional_bagua.compat as bagua

    assert bagua.version == torch.__version__


def test_bagua_environment_helpers_and_backend_comm(monkeypatch):
    from functional_bagua.compat import communication

    monkeypatch.delenv("BAGUA_AUTOTUNE_SERVER_WAIT_TIME", raising=False)
    assert communication.get_autotune_server_wait_time() == 300
    monkeypatch.setenv("BAGUA_AUTOTUNE_SERVER_WAIT_TIME", "12")
    assert communication.get_autotune_server_wait_time() == 12
    assert communication._autotune_server is None and communication._autotune_service_port is None
    marker = object()
    assert communication._bagua_backend_comm(marker) is marker
    assert communication._bagua_backend_comm(communication.CommMember.NON_COMM_MEMBER) is None


def test_modules_get_bagua_module_methods():
    from functional_bagua.compat import BaguaModule

    assert torch.nn.Module.with_bagua is BaguaModule.with_bagua
    assert torch.nn.Module.bagua_build_params is BaguaModule.bagua_build_params
    assert [name for name, _ in torch.nn.Linear(2, 1).bagua_build_params()] == [".weight", ".bias"]
