"""Fixtures of the in-process tests: transformers' copy of the tiny model and its vocabulary size; and the
rule of this directory, that a unit test starts no process and serves on no socket.

The rule is kept by `no_processes`, on for every test here: starting a subprocess, a multiprocessing
process, a fork or `os.system`, or listening on a socket fails the test, naming the directories where such a
test belongs (tests/integration for nodes and ranks, tests/transfer for its servers, tests/fresh_process for
a fresh interpreter or the compiler, tests/deploy for the launcher and the CLI). The native CPU kernels are
compiled before it, once per session, where the library's cache lacks this version (a machine set up by
`make setup` has it already).
"""

from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess

import pytest
import torch

WHERE = ("a unit test starts no process and serves on no socket; one that must belongs beside those that do: "
         "tests/integration (nodes, ranks), tests/transfer (its servers), tests/fresh_process (a fresh "
         "interpreter, the compiler) or tests/deploy (the launcher, the CLI)")


class ProcessInUnitTest(AssertionError):
    pass


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise ProcessInUnitTest(f"{what}: {WHERE}")

    return refuse


@pytest.fixture(scope="session")
def native_kernels_built() -> None:
    from common.layers import native

    native.build()


@pytest.fixture(autouse=True)
def no_processes(native_kernels_built, monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("a subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("a multiprocessing process"))
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse(f"os.{name}"))
    monkeypatch.setattr(socket.socket, "listen", _refuse("a listening socket"))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    m.eval()
    m.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like ignore_eos
    m.generation_config.pad_token_id = 0
    return m


@pytest.fixture(scope="module")
def vocab(hf_model):
    return hf_model.config.vocab_size
