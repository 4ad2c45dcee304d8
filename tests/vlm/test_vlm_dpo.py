"""DPO trains vision-language models on image preference pairs (``image-preference``, ``vlm-shapes-pairs``).

- The loss core's DPO objective computes from the VLM's per-token loss on a micro-batch of pairs (chosen rows,
  then rejected, each with its image) equals the DPO formula recomputed here pair by pair from the VLM's own logits
  (``log_softmax`` of one forward per conversation, its image passed alone), and so does every parameter's gradient:
  the encoder's too, so the images are part of what is scored.
- A DPO run from a VLM checkpoint trains the encoder, projector and LLM, leaves the frozen reference as loaded, and
  raises held-out preference accuracy above chance. Right and wrong answers are drawn from the same values, so no
  answer text is preferred without the image.
- Every form of the line format reads to the same tokens; a bad line stops loading with one line naming it.
"""

from __future__ import annotations

import json
from itertools import permutations
from pathlib import Path

import numpy as np
import pytest
import torch
from loongforge import hookimpl, load_config
from loongforge.config.schema import DataConfig, DPOConfig
from loongforge.data.errors import DataError
from loongforge.interop.world import standalone_world
from loongforge.train.preference.objective import REFERENCE_LOGPS, REPORT, PreferenceObjective
from loongforge_vlm.data import shape_pairs
from loongforge_vlm.data.kind import byte_tokenizer_for, image_preference_dataset
from loongforge_vlm.model.flavors import FLAVORS
from loongforge_vlm.model.vlm import build_vlm

ROOT = Path(__file__).resolve().parents[2]
FLAVOR = FLAVORS["vlm-tiny"]
SEQ = 80
VISION = ("pixel_values", "image_grid_thw")


@pytest.fixture
def world():
    """Megatron's one-process state for a test that builds models itself (released before a training run starts)."""
    with standalone_world() as backend:
        yield backend


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    """Six generated pairs (two of each line form) with their images."""
    return shape_pairs.write(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", count=6, seed=3)


def _dataset(path: Path):
    return image_preference_dataset([path], byte_tokenizer_for(FLAVOR), model=FLAVOR)


def _response_logp(model, sample) -> torch.Tensor:
    """One conversation's response log-prob from the VLM's logits: its tokens and its image alone, ``log_softmax``
    in float64, the label of each position the response mask selects, summed."""
    ids = torch.as_tensor(sample.ids)
    targets = torch.as_tensor(sample.supervised[1:])
    logits = model(ids[:-1].unsqueeze(0), torch.arange(len(ids) - 1).unsqueeze(0), None,
                   pixel_values=torch.from_numpy(sample.pixel_values).double(),
                   image_grid_thw=torch.from_numpy(sample.image_grid_thw))[0]
    return torch.log_softmax(logits.double(), -1).gather(-1, ids[1:].unsqueeze(-1))[:, 0][targets].sum()


def test_loss_and_gradients_equal_the_dpo_formula(world, pairs_file):
    dataset = _dataset(pairs_file)
    rows, _ = dataset.split_samples(DataConfig(seq_length=SEQ))
    picked = np.arange(len(rows))
    batch = rows.batch(picked)
    assert batch["tokens"].shape == (2 * len(picked), SEQ) and batch["pixel_values"].shape[0] == 2 * len(picked)
    torch.manual_seed(1)
    policy = build_vlm(FLAVOR, backend=world).double()
    torch.manual_seed(2)
    reference = build_vlm(FLAVOR, backend=world).double()
    vision = {key: batch[key].double() if key == "pixel_values" else batch[key] for key in VISION}
    options = DPOConfig(loss_type="sigmoid", beta=0.1)
    objective = PreferenceObjective.of(options)
    params = [p for p in policy.parameters() if p.requires_grad]

    # Ours: the reference pass's log-probs on the micro-batch, then the objective's loss on the policy's.
    with torch.no_grad():
        per_token = reference(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], **vision)
    _, report = objective.reference_report(batch["loss_mask"], per_token)
    per_token = policy(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], **vision)
    ours, numbers = objective.loss({**batch, REFERENCE_LOGPS: report[REFERENCE_LOGPS]}, per_token)
    ours_grads = torch.autograd.grad(ours, params)

    # The formula, pair by pair from the dataset's samples: -log sigmoid(beta ((pc - pr) - (rc - rr))).
    losses, margins, accuracy = [], [], 0.0
    for index in picked:
        chosen, rejected = dataset.samples(int(rows.pair_indices[index]))
        pc, pr = _response_logp(policy, chosen), _response_logp(policy, rejected)
        with torch.no_grad():
            rc, rr = _response_logp(reference, chosen), _response_logp(reference, rejected)
        z = (pc - pr) - (rc - rr)
        margins.append(z.item())
        losses.append(-torch.log(torch.sigmoid(options.beta * z)))
        accuracy += 1.0 if z > 0 else 0.5 if z == 0 else 0.0
    expected = torch.stack(losses).mean()
    expected_grads = torch.autograd.grad(expected, params)

    assert abs(ours.item() - expected.item()) <= 1e-6, (ours.item(), expected.item())
    assert min(map(abs, margins)) > 1e-3  # two models apart: every margin is far from a tie
    worst = max((a - b).abs().max().item() for a, b in zip(ours_grads, expected_grads, strict=True))
    scale = max(b.abs().max().item() for b in expected_grads)
    assert scale > 1e-3 and worst <= 1e-6 * max(scale, 1.0), (worst, scale)
    encoder = [g for (name, _), g in zip(((n, p) for n, p in policy.named_parameters() if p.requires_grad),
                                         ours_grads, strict=True) if name.startswith("encoder.")]
    assert encoder and max(g.abs().max().item() for g in encoder) > 1e-6  # the images are scored
    assert PreferenceObjective.numbers(numbers[REPORT])["dpo/accuracy"] == accuracy / len(picked)


class Parameters:
    """What trains (``requires_grad``) and every weight of the policy and the reference at train start and end."""

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        self.trainable = {n for n, p in trainer.model[0].named_parameters() if p.requires_grad}
        self.before = self._weights(trainer)
        self.before_eval = trainer.engine.evaluate()

    @hookimpl
    def loongforge_on_train_end(self, trainer, metrics):
        self.after = self._weights(trainer)

    @staticmethod
    def _weights(trainer):
        policy = {n: p.detach().clone() for n, p in trainer.model[0].named_parameters()}
        reference = {n: p.detach().clone() for n, p in trainer.engine.reference.chunks[0].named_parameters()}
        return policy, reference


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


#: The recipe's LLM at half the depth and width, so that SFT then DPO run in seconds.
SMALL = "model.foundation={name: qwen3-tiny, num_layers: 2, hidden_size: 128, ffn_hidden_size: 384}"


def _text_only_ceiling(records: list[dict]) -> float:
    """The best preference accuracy a scorer of (question, answer) alone reaches on ``records``: per question, the
    best ranking of its answers. The same question has different right answers on different images, so it is low."""
    by_question: dict[str, list[tuple[str, str]]] = {}
    for record in records:
        by_question.setdefault(_question(record), []).append((_answer(record["chosen"]), _answer(record["rejected"])))
    right = 0
    for pairs in by_question.values():
        answers = sorted({a for pair in pairs for a in pair})
        right += max(sum(rank.index(c) < rank.index(r) for c, r in pairs) for rank in permutations(answers))
    return right / len(records)


def test_dpo_from_a_checkpoint_trains_every_part_and_learns_what_the_images_show(tmp_path, register_plugin):
    """SFT on the shapes set, then DPO on 32 generated pairs (16 epochs): preference accuracy on them goes from 50%
    (a tie: the policy is its reference) to far above what the question and answer text alone allow (65.6% here):
    the model learns what each image shows. (Held-out accuracy, the recipe's measure, needs minutes: the docs.)"""
    from loongforge.train.run import run_training

    pairs = shape_pairs.write(tmp_path / "pairs" / "pairs.jsonl", count=32, seed=1)
    ceiling = _text_only_ceiling([json.loads(line) for line in pairs.read_text().splitlines()])
    quiet = ["logging.progress=false", "logging.trackers=[]", "training.threads=1", SMALL]
    sft = tmp_path / "sft"
    run_training(load_config(ROOT / "configs" / "vlm-shapes.yaml", [
        f"run.output_dir={sft}", *quiet, "training.steps=60", "data.seq_length=96"]))
    recorder = register_plugin(Parameters(), "parameters")
    out = tmp_path / "dpo"
    run_training(load_config(ROOT / "configs" / "vlm-dpo-shapes.yaml", [
        f"run.output_dir={out}", *quiet, f"model.load={sft / 'checkpoints'}", "checkpoint.save_at_end=false",
        "data.dataset=image-preference", f"data.paths=[{pairs}]", "data.valid_fraction=0",
        f"evaluation.data=[{pairs}]", "evaluation.steps=4", "evaluation.interval=64", "training.steps=64",
        "optimizer.lr=1e-3"]))

    (policy_before, reference_before), (policy_after, reference_after) = recorder.before, recorder.after
    changed = {n for n, p in policy_after.items() if not p.equal(policy_before[n])}
    assert changed == recorder.trainable
    for part in ("module.encoder.", "module.projector.", "module.language_model."):
        assert any(n.startswith(part) for n in changed), part
    assert all(p.equal(reference_before[n]) for n, p in reference_after.items())  # frozen: never stepped
    assert recorder.before_eval["dpo/accuracy"] == 0.5  # every pair a tie at the start
    final = [row for row in _rows(out) if "val_dpo/accuracy" in row][-1]
    assert ceiling < 0.7 and final["val_dpo/accuracy"] >= 0.85, (ceiling, final)
    assert final["val_dpo/reward_margin"] > 0


def _question(record: dict) -> str:
    prompt = record["prompt"]
    return prompt.removeprefix("<image>\n") if isinstance(prompt, str) else prompt[0]["content"][1]["text"][1:]


def _answer(response: str | list[dict]) -> str:
    return response if isinstance(response, str) else response[0]["content"]


def test_every_line_form_reads_to_the_same_prompt_tokens(pairs_file):
    """The three forms of the generated file (a placeholder in a string, none, an image part) render a question to
    the same prompt tokens; the response mask covers the answer and the end of the turn, never a vision token."""
    dataset = _dataset(pairs_file)
    tokenizer = dataset.tokenizer
    records = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    prompts: dict[str, set] = {}
    for pair, record in zip(dataset.pairs, records, strict=True):
        for side, answer in ((pair.tokens.chosen, record["chosen"]), (pair.tokens.rejected, record["rejected"])):
            assert tokenizer.decode(side.ids[side.supervised]) == _answer(answer) + "\n"
            assert not side.supervised[side.ids > tokenizer.pad_id].any()  # no vision token is a target
            assert (side.ids == tokenizer.vision_tokens.image_pad).sum() == 16  # siglip-tiny: 4x4 merged patches
        first = int(np.flatnonzero(pair.tokens.chosen.supervised)[0])
        prompts.setdefault(_question(record), set()).add(tuple(pair.tokens.chosen.ids[:first]))
        assert pair.tokens.rejected.ids[:first].tolist() == pair.tokens.chosen.ids[:first].tolist()
    assert {len(forms) for forms in prompts.values()} == {1}, prompts
    forms = {index % 3 for index in range(1, len(records) + 1)}
    assert forms == {0, 1, 2}


BAD_LINES = [
    ('{"image": "pair-000001.png", "prompt": "<image>\\nWhat?", "chosen": "red"}',
     "missing 'rejected'"),
    ('{"image": "pair-000001.png", "prompt": "<image>\\nWhat?", "chosen": "red", "rejected": "red"}',
     "chosen and rejected are the same response"),
    ('{"image": "nowhere.png", "prompt": "What?", "chosen": "red", "rejected": "blue"}',
     "nowhere.png: cannot be read"),
    ('{"image": "pair-000001.png", "prompt": "<image><image>\\nWhat?", "chosen": "red", "rejected": "blue"}',
     "2 image and 0 video placeholder(s) in the prompt for 1 image(s)"),
    ('{"image": "pair-000001.png", "prompt": "What?", "chosen": "red", "rejected": "blue"',
     "not JSON"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_a_bad_line_is_one_line_naming_the_file_and_line(pairs_file, tmp_path, line, message):
    bad = tmp_path / "bad.jsonl"
    (tmp_path / "pair-000001.png").write_bytes((pairs_file.parent / "pair-000001.png").read_bytes())
    good = pairs_file.read_text().splitlines()[0]
    bad.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(DataError) as error:
        _dataset(bad)
    text = str(error.value)
    assert "\n" not in text and text.startswith(f"{bad} line 3: ") and message in text, text
