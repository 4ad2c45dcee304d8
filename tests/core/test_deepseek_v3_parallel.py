"""The DeepSeek family across parallel layouts (gloo, two processes): each reproduces one process.

* MLA's gradients at tp=2, with and without sequence parallelism, equal one rank's -- and megatron's own
  ``MLASelfAttention`` (what :class:`~loongforge.models.deepseek.attention.DeepSeekMLA` corrects) does not: the
  rotated key is shared by all heads, and megatron drops the other ranks' heads' share of its gradient;
* Hugging Face weights loaded at tp=2 + sequence parallel, ep=2 and pp=2 and gathered back give the same files bit
  for bit (what ``model.load: hf:`` and ``checkpoint.save_hf`` do at a layout);
* ``loongforge train`` of the tiny flavor for 10 steps at tp=2 + sequence parallel, ep=2 and pp=2 matches one process
  (per-step loss within 1e-5, grad norm within 2e-5), and the aux-loss-free expert bias in the step-5 and step-10
  checkpoints is bit for bit the single process's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import free_port
from hf_layout_roundtrip import LAYOUTS as HF_LAYOUTS
from hf_layout_roundtrip import round_trip
from test_parallel_parity import RTOL, STEPS, max_rel_diff, train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

HERE = os.path.dirname(__file__)


def _spawn(tmp_path, script: str, *args: str) -> None:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(script))
    done = subprocess.run([sys.executable, str(path), str(free_port()), str(tmp_path), HERE, *args],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


# -- MLA gradients at tp=2 -------------------------------------------------------------------------------------------

SEQ, BATCH = 8, 2

MLA_SCRIPT = """
import os, sys
import torch, torch.distributed as dist

def worker(rank, port, out_dir, test_dir, sp, module):
    sys.path.insert(0, test_dir)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from loongforge.devices.cpu import CPUBackend
    from megatron.core import parallel_state, tensor_parallel
    import test_deepseek_v3_parallel as t
    backend = CPUBackend()
    backend.apply_patches()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(2, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    mla = t.build_mla(backend, tp=2, sequence_parallel=sp == "1", module=module)
    result = t.mla_grads(mla, rank, 2, sp == "1")
    torch.save(result, os.path.join(out_dir, f"{module}-sp{sp}-rank{rank}.pt"))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()

if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(worker, args=tuple(sys.argv[1:]), nprocs=2)
"""


def build_mla(backend, *, tp: int, sequence_parallel: bool, module: str = "deepseek"):
    """The tiny flavor's attention (``deepseek``: the family's; ``megatron``: megatron's ``MLASelfAttention`` with the
    same modules) at ``tp``."""
    from loongforge.models.decoder_model import DecoderSpec, ParallelSettings, transformer_config
    from loongforge.models.deepseek.flavors import FLAVORS
    from loongforge.models.deepseek.layer_spec import config_fields, mla_attention_spec
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    flavor = FLAVORS["deepseek-v3-tiny"].with_overrides(num_experts=None)
    spec = DecoderSpec(config_class=MLATransformerConfig, config_fields=config_fields(flavor))
    config = transformer_config(flavor, parallel=ParallelSettings(tp=tp, sequence_parallel=sequence_parallel),
                                spec=spec)
    attention = mla_attention_spec(backend.spec_provider(), flavor)
    if module == "megatron":
        attention.module = MLASelfAttention
    return build_module(attention, config=config, layer_number=1)


def mla_grads(mla, rank: int, tp: int, sequence_parallel: bool) -> dict:
    """Weights cut from seeded full tensors, a seeded input (this rank's tokens with sequence parallelism), forward
    and backward; the parameters' gradients (replicated ones summed over the ranks' tokens) and the input's."""
    import torch.distributed as dist
    from loongforge.parallel.init import full_shape, local_slice

    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in sorted(mla.named_parameters()):
            full = torch.randn(full_shape(param, tp), generator=gen) * 0.2 + (1.0 if "layernorm" in name else 0.0)
            param.copy_(local_slice(full, param, rank, tp))
    x, weight = (torch.randn(SEQ, BATCH, 128, generator=gen) for _ in range(2))
    if sequence_parallel:
        x, weight = x.chunk(tp)[rank], weight.chunk(tp)[rank]
    x = x.clone().requires_grad_()
    out, _ = mla(x, None)
    (out * weight).sum().backward()
    grads = {}
    for name, param in mla.named_parameters():
        grad = param.grad.clone()
        if tp > 1 and sequence_parallel and getattr(param, "sequence_parallel", False):
            dist.all_reduce(grad)  # what finalize_model_grads does for them
        grads[name] = (grad, param.partition_dim if getattr(param, "tensor_model_parallel", False) else None)
    return {"grads": grads, "x_grad": x.grad}


@pytest.fixture(scope="module")
def mla_reference():
    from loongforge.interop.world import standalone_world

    with standalone_world() as backend:
        return mla_grads(build_mla(backend, tp=1, sequence_parallel=False), 0, 1, False)


def _mla_errors(tmp_path, reference, module: str, sp: str) -> dict[str, float]:
    _spawn(tmp_path, MLA_SCRIPT, sp, module)
    parts = [torch.load(tmp_path / f"{module}-sp{sp}-rank{rank}.pt") for rank in range(2)]
    errors = {}
    for name, (grad, _) in reference["grads"].items():
        dim = parts[0]["grads"][name][1]
        pieces = [p["grads"][name][0] for p in parts]
        got = torch.cat(pieces, dim=dim) if dim is not None else pieces[0]
        errors[name] = (got - grad).abs().max().item() / max(grad.abs().max().item(), 1.0)
    x_grad = torch.cat([p["x_grad"] for p in parts]) if sp == "1" else parts[0]["x_grad"]
    errors["input"] = (x_grad - reference["x_grad"]).abs().max().item()
    return errors


@pytest.mark.parametrize("sp", ["1", "0"])
def test_mla_gradients_at_tp2_match_one_rank(tmp_path, mla_reference, sp):
    errors = _mla_errors(tmp_path, mla_reference, "deepseek", sp)
    assert max(errors.values()) <= 1e-5, errors


def test_megatron_mla_drops_the_rotated_keys_gradient_at_tp2(tmp_path, mla_reference):
    """The negative control: the same modules in megatron's own class get the down-projection wrong."""
    errors = _mla_errors(tmp_path, mla_reference, "megatron", "1")
    assert errors["linear_kv_down_proj.weight"] > 1e-2 and errors["input"] > 1e-2
    assert errors["linear_q_up_proj.weight"] <= 1e-5  # only what the rotated key feeds


# -- Hugging Face weights at a layout and back ----------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(HF_LAYOUTS))
def test_hf_weights_through_a_layout_come_back_bitwise(tmp_path, layout):
    from test_deepseek_v3 import hf_model, read_flavor

    reference = hf_model("v3")
    adapter = read_flavor(reference).hf_adapter()
    files = adapter.to_hf(adapter.from_hf(reference.state_dict()))  # the per-expert layout checkpoints store
    config = json.loads(reference.config.to_json_string())
    back = round_trip(tmp_path, config, files, *HF_LAYOUTS[layout])
    assert sorted(back) == sorted(files) and all(torch.equal(back[k], files[k]) for k in files)


# -- training layouts -----------------------------------------------------------------------------------------------

CONFIG = """
run: {output_dir: OUT, seed: 11}
model: {name: deepseek-v3-tiny}
data: {seq_length: 32}
optimizer: {lr: 0.002}
scheduler: {warmup_steps: 2}
training: {steps: 10, micro_batch_size: 2, global_batch_size: 4, threads: 1}
checkpoint: {save_at_end: true, interval: 5, resume: never, keep_last: 0}
logging: {interval: 10, progress: false, tensorboard: false}
"""
LAYOUTS = {
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "ep2": ["parallel.ep=2"],
    "pp2": ["parallel.pp=2"],
}


def expert_biases(checkpoint) -> dict[str, torch.Tensor]:
    """Each router's expert bias in a training checkpoint (by router name, the MTP block's too), read into a
    one-process model by ``dist_checkpointing`` (which reshards any layout)."""
    from loongforge.interop.mcore_checkpoint import checkpoint_config, load_model_weights, resolve_family
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone
    from megatron.core.transformer.moe.router import TopKRouter

    with standalone_world() as backend:
        model = build_standalone(resolve_family(checkpoint_config(checkpoint)), backend)
        load_model_weights(checkpoint, [model])
        return {name: m.expert_bias.clone() for name, m in model.named_modules() if isinstance(m, TopKRouter)}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("deepseek-layouts")


@pytest.fixture(scope="module")
def reference(root):
    rows, stdout = train(root, "single", config_text=CONFIG)
    assert "deepseek-v3-tiny" in stdout and "2 micro-batches/step" in stdout
    assert rows[STEPS]["loss"] < rows[1]["loss"] - 0.5
    biases = {step: expert_biases(root / "single" / "checkpoints" / f"step-{step:07d}") for step in (5, STEPS)}
    routers = [f"decoder.layers.{i}.mlp.router" for i in (1, 2, 3)] + ["mtp.layers.0.transformer_layer.mlp.router"]
    assert sorted(biases[STEPS]) == routers and all(b.abs().max() > 0 for b in biases[STEPS].values())
    assert any(not torch.equal(biases[5][k], biases[STEPS][k]) for k in biases[5])  # it keeps moving
    return rows, biases


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process_and_its_expert_bias(root, reference, name):
    rows, stdout = train(root, name, *LAYOUTS[name], nproc=2, config_text=CONFIG)
    assert "world size 2" in stdout
    reference_rows, reference_biases = reference
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert max_rel_diff(rows, reference_rows, "loss") <= RTOL
    assert max_rel_diff(rows, reference_rows, "mtp_loss") <= RTOL  # the MTP block on the last stage at pp=2
    # Step 10's batch holds a near-tie of routing scores: summed in another order its gradient norm moves by up to
    # 8e-6 (relative) in these layouts, every other step by < 1e-6; 2e-5 still fails megatron's MLA gradient at tp=2
    # (2.7e-5 from step 1, and a loss off by 5e-5 by step 6).
    assert max_rel_diff(rows, reference_rows, "grad_norm") <= 2 * RTOL
    for step in (5, STEPS):
        biases = expert_biases(root / name / "checkpoints" / f"step-{step:07d}")
        assert biases.keys() == reference_biases[step].keys()
        for layer, bias in biases.items():
            assert torch.equal(bias, reference_biases[step][layer]), (name, step, layer)
