"""HF interop at tp=2, pp=2 and (MoE) ep=2 (torchrun, two gloo processes).

One torchrun launch per layout does two things on every rank:

1. for each family (dense and MoE; MoE at tp=2 with sequence parallelism, as megatron requires), builds the
   model at the layout, loads a HF checkpoint through the ``model.load`` hook
   (each rank cuts its slices), runs a forward pass (pp=2: the first stage sends its hidden states to the
   second) and gathers the shards back to full HF tensors on rank 0;
2. (tp=2 and pp=2) trains one step from ``model.load: hf:`` with lr=0 and ``checkpoint.save_hf`` -- a real
   trainer checkpoint written at this layout.

This process then checks: logits within 1e-4 of transformers, gathered tensors and the checkpoint's ``hf/``
bitwise equal to the source, and ``loongforge convert mcore-to-hf`` of the tp=2/pp=2 checkpoint (resharded
to one process by dist_checkpointing) bitwise equal too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import HF_FAMILY_CASES, HF_TINY_CASES, HF_TINY_COMMON, free_port, make_hf_model, tiny_settings
from loongforge.cli import main  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

DENSE = ("llama3-rope-untied", "qwen2-bias-tied", "qwen3-qknorm-tied", *sorted(HF_FAMILY_CASES))
MOE = ("mixtral-top2", "qwen3-moe-top4")
LLAMA_DEBUG = dict(intermediate_size=176, max_position_embeddings=1024, rms_norm_eps=1e-5,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    from safetensors.torch import save_file

    def forward(model, tokens, pp):
        from megatron.core import parallel_state as ps, tensor_parallel
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
        with torch.no_grad():
            if pp == 1:
                return tensor_parallel.gather_from_tensor_model_parallel_region(model(tokens, positions, None))
            hidden = torch.empty(tokens.shape[1], tokens.shape[0], model.config.hidden_size)
            if ps.is_pipeline_first_stage():
                dist.send(model(tokens, positions, None).contiguous(), 1)
                return None
            dist.recv(hidden, 0)
            model.set_input_tensor(hidden)
            return model(tokens, positions, None)

    def main():
        tp, pp, ep, root = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        from loongforge.devices.cpu import CPUBackend
        backend = CPUBackend()
        backend.apply_patches()
        from megatron.core import parallel_state as ps, tensor_parallel
        from loongforge import load_config
        from loongforge.models.hf_adopt import name_model
        from loongforge.models.hf_format import read_hf_model
        from loongforge.interop.online import load_initial_weights
        from loongforge.interop.sharding import gather_full_state
        from loongforge.models.decoder_model import ParallelSettings, build_model
        from loongforge.models.hf_adapter import megatron_to_hf

        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        tokens = torch.load(os.path.join(root, "tokens.pt"), weights_only=True)
        for case in sys.argv[5:]:
            hf_dir = os.path.join(root, case)
            flavor = read_hf_model(hf_dir).family
            name, overrides = name_model(flavor, None, hf_dir)
            config = load_config(None, [f"model.name={name}", f"model.load=hf:{hf_dir}"])
            config.model.overrides = overrides
            layout = ParallelSettings(tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1 and flavor.is_moe)
            model = build_model(flavor, backend=backend, parallel=layout,
                                pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
            load_initial_weights([model], config)
            logits = forward(model.eval(), tokens, pp)
            if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
                torch.save(logits, os.path.join(root, f"logits-{case}.pt"))
            full = gather_full_state([model])
            if rank == 0:
                tensors = megatron_to_hf(full, flavor, per_expert=True)
                save_file(tensors, os.path.join(root, f"gathered-{case}.safetensors"))
        ps.destroy_model_parallel()
        if ep > 1:
            return

        from loongforge.train.run import run_training
        run_training(load_config(None, [
            f"run.output_dir={root}/run", "model.name=llama-debug", f"model.load=hf:{root}/llama-debug-twin",
            f"parallel.tp={tp}", f"parallel.pp={pp}", "data.seq_length=32", "training.micro_batch_size=2",
            "training.steps=1", "training.threads=1", "optimizer.lr=0", "optimizer.min_lr=0",
            "logging.progress=false", "logging.tensorboard=false", "checkpoint.save_hf=true",
        ]))
        dist.destroy_process_group()

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.parametrize("tp,pp,ep,cases", [(2, 1, 1, DENSE + MOE), (1, 2, 1, DENSE + MOE), (1, 1, 2, MOE)],
                         ids=["tp2", "pp2", "ep2"])
def test_hf_interop_at_two_process_layout(tmp_path, capsys, tp, pp, ep, cases):
    tokens = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(5))
    torch.save(tokens, tmp_path / "tokens.pt")
    expected = {}
    for case in cases:
        config_cls, model_cls, _ = HF_TINY_CASES[case]
        hf = make_hf_model(config_cls, model_cls, tiny_settings(case))
        hf.save_pretrained(tmp_path / case)
        with torch.no_grad():
            expected[case] = hf(tokens).logits
    twin = make_hf_model("LlamaConfig", "LlamaForCausalLM", {**HF_TINY_COMMON, **LLAMA_DEBUG}, seed=1)
    twin.save_pretrained(tmp_path / "llama-debug-twin")

    script = tmp_path / "interop.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), str(tp), str(pp), str(ep), str(tmp_path), *cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-20000:]

    for case in cases:
        logits = torch.load(tmp_path / f"logits-{case}.pt", weights_only=True)
        diff = (logits[..., : expected[case].shape[-1]] - expected[case]).abs().max().item()  # real vocab rows
        print(f"\ntp={tp} pp={pp} ep={ep} {case}: max |logits - transformers| = {diff:.2e}")
        assert diff <= 1e-4
        source = load_file(tmp_path / case / "model.safetensors")
        gathered = load_file(tmp_path / f"gathered-{case}.safetensors")
        assert sorted(gathered) == sorted(source) and all(torch.equal(gathered[k], source[k]) for k in source)
    if ep > 1:
        return

    source = load_file(tmp_path / "llama-debug-twin" / "model.safetensors")
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000001"
    assert main(["convert", "mcore-to-hf", str(ckpt), str(tmp_path / "converted")]) == 0
    for written in (ckpt / "hf" / "model.safetensors", tmp_path / "converted" / "model.safetensors"):
        tensors = load_file(written)
        assert sorted(tensors) == sorted(source) and all(torch.equal(tensors[k], source[k]) for k in source)
