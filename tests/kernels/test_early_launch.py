"""Which kernels let the next one launch before they wait (wgmma.early_pdl): a tree verify's norms, heads and
attention, where the next projection is the Hopper GEMM's (33-136 rows). Elsewhere the next kernel is the
few-row GEMM, the GEMV or cuBLAS, where an early launch made rounds slower."""

import pytest
import torch
from ddtree.kernels import wgmma
from ddtree.switches import override

CPU = torch.device("cpu")  # the rule reads only pdl(device), patched here as a Hopper GPU's answer


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(wgmma, "pdl", lambda device: True)
    with override(wgmma=True):
        yield


@pytest.mark.parametrize("step", ["norm", "heads", "attention"])
@pytest.mark.parametrize(("rows", "early"), [(65, True), (33, True), (129, True), (136, True), (17, False),
                                             (16, False), (1, False), (137, False), (512, False)])
def test_only_rows_the_hopper_gemm_takes_next_launch_early(hopper, step, rows, early):
    assert wgmma.early_pdl(CPU, rows, step) == (2 if early else 1)


def test_early_launches_turn_off_by_step_by_switch_and_without_pdl_or_the_gemm(hopper, monkeypatch):
    assert wgmma.early_pdl(CPU, 65, "silu") == 1  # a step not in the set
    monkeypatch.setattr(wgmma, "EARLY_STEPS", wgmma.EARLY_STEPS - {"norm"})
    assert wgmma.early_pdl(CPU, 65, "norm") == 1
    assert wgmma.early_pdl(CPU, 65, "attention") == 2
    with override(wgmma=False):  # DDTREE_WGMMA=0: cuBLASLt's GEMMs do not wait, nor preload
        assert wgmma.early_pdl(CPU, 65, "attention") == 1
    monkeypatch.setattr(wgmma, "pdl", lambda device: False)
    assert wgmma.early_pdl(CPU, 65, "attention") == 0


def test_switches_come_from_the_environment_and_override_restores_them():
    from ddtree.switches import SWITCHES, from_environment

    assert from_environment({}) == from_environment({"DDTREE_PDL": "1"})
    assert not from_environment({"DDTREE_PDL": "0"}).pdl and from_environment({"DDTREE_PDL": "0"}).wgmma
    before = (SWITCHES.pdl, SWITCHES.compile)
    with override(pdl=not before[0], compile=not before[1]):
        assert (SWITCHES.pdl, SWITCHES.compile) == (not before[0], not before[1])
    assert (SWITCHES.pdl, SWITCHES.compile) == before
    with pytest.raises(TypeError, match="unknown switch"), override(gemv=False):
        pass
