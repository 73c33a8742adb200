"""How an engine that moves KV stages off a GPU has PyTorch page-lock host memory."""

from __future__ import annotations

from llumdask.engine.pinned_memory import REGISTER_IN_PLACE, register_in_place


def test_nothing_set_gets_registration_in_place_under_the_cuda_variable():
    environ: dict[str, str] = {}
    assert register_in_place(environ) == "PYTORCH_CUDA_ALLOC_CONF"
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": REGISTER_IN_PLACE}
    register_in_place(environ)  # once is enough: applying it again changes nothing
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": REGISTER_IN_PLACE}


def test_other_settings_are_kept_in_the_variable_that_holds_them():
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    register_in_place(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:True,{REGISTER_IN_PLACE}"}
    environ = {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": ""}
    assert register_in_place(environ) == "PYTORCH_ALLOC_CONF"
    assert environ["PYTORCH_ALLOC_CONF"] == f"expandable_segments:True,{REGISTER_IN_PLACE}"
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == ""


def test_the_users_own_choice_stands():
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}
    register_in_place(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}
