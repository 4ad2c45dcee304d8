"""Videos beside images: logits of Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense and MoE) against transformers with several
images and a video in one padded batch, the video pixels and frame sampling against transformers' own video
processor code, the video field of the jsonl records (files, GIFs, frame directories; one-line errors) and a video
sample that trains.

The reference configs are written here with transformers' config classes (never derived from our flavors); our
model is the plugin's tiny flavor of the same sizes, loaded from the perturbed reference weights.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from loongforge.parallel.packed_rows import PackedRows
from loongforge_vlm.model.flavors import FLAVORS
from loongforge_vlm.model.hf_interop import from_hf
from loongforge_vlm.model.vlm import build_vlm
from vlm_reference import megatron_world, perturbed

IMAGE, VIDEO, START, END = 380, 381, 382, 383
_TEXT = dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=384,
             max_position_embeddings=1024, rms_norm_eps=1e-6, hidden_act="silu")
_VISION = dict(in_channels=3, patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
               rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
_TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)


def _reference_config(name: str):
    """The transformers config of each tiny flavor, written out with transformers' own classes."""
    if name == "qwen2-vl-tiny":
        return transformers.Qwen2VLConfig(
            text_config=dict(_TEXT, num_hidden_layers=2, use_sliding_window=False,
                             rope_parameters={"rope_type": "default", "mrope_section": [1, 2, 3], "rope_theta": 100.0}),
            vision_config=dict(_VISION, depth=2, num_heads=2, hidden_act="quick_gelu", embed_dim=32, mlp_ratio=4,
                               hidden_size=48),
            tie_word_embeddings=False, attn_implementation="eager", **_TOKENS)
    if name == "qwen2.5-vl-tiny":
        return transformers.Qwen2_5_VLConfig(
            text_config=dict(_TEXT, num_hidden_layers=2, use_sliding_window=False,
                             rope_parameters={"rope_type": "default", "mrope_section": [1, 2, 3], "rope_theta": 100.0}),
            vision_config=dict(_VISION, depth=4, num_heads=2, hidden_act="silu", hidden_size=32, intermediate_size=40,
                               out_hidden_size=48, window_size=16, fullatt_block_indexes=[1, 3], tokens_per_second=2),
            tie_word_embeddings=True, attn_implementation="eager", **_TOKENS)
    # Qwen3-VL, dense or with 6 experts of width 40 routed 2 per token in every layer (router: softmax, top-k,
    # renormalised -- transformers' Qwen3VLMoeTextTopKRouter).
    moe = name == "qwen3-vl-moe-tiny"
    experts = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40) if moe else {}
    return getattr(transformers, "Qwen3VLMoeConfig" if moe else "Qwen3VLConfig")(
        text_config=dict(_TEXT, num_hidden_layers=3, head_dim=16, attention_bias=False, **experts,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2], "rope_theta": 100.0,
                                          "mrope_interleaved": True}),
        vision_config=dict(_VISION, depth=3, num_heads=4, hidden_act="gelu_pytorch_tanh", hidden_size=32,
                           intermediate_size=40, out_hidden_size=48, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 2]),
        tie_word_embeddings=False, attn_implementation="eager", **_TOKENS)


#: Sample 0: an image, then a 6-frame video (3 temporal patches); sample 1 (left-padded): two images.
IMAGE_GRIDS = ((1, 4, 8), (1, 4, 4), (1, 8, 4))
VIDEO_GRID = (3, 4, 4)
#: Qwen2.5-VL: seconds per temporal patch (2 frames at 8/3 fps): frames 2 * 0.75 = 1.5 positions apart, so the
#: truncation of 1.5 and 3.0 to integers is exercised.
SECONDS_PER_PATCH = 0.75


def _batch(timestamped: bool, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def text(count: int) -> list[int]:
        return torch.randint(0, 300, (count,), generator=generator).tolist()

    def vision(token: int, grid: tuple[int, int, int]) -> list[int]:
        return [START, *[token] * (grid[0] * grid[1] * grid[2] // 4), END]

    t, h, w = VIDEO_GRID
    if timestamped:  # Qwen3-VL: "<t seconds>" (3 text tokens here) before every frame group
        video = [token for _ in range(t) for token in text(3) + vision(VIDEO, (1, h, w))]
    else:
        video = vision(VIDEO, VIDEO_GRID)
    first = text(5) + vision(IMAGE, IMAGE_GRIDS[0]) + text(3) + video + text(4)
    second = text(4) + vision(IMAGE, IMAGE_GRIDS[1]) + text(2) + vision(IMAGE, IMAGE_GRIDS[2]) + text(3)
    length = max(len(first), len(second) + 3)
    rows = [first + [0] * (length - len(first)), [0] * (length - len(second)) + second]
    masks = [[1] * len(first) + [0] * (length - len(first)), [0] * (length - len(second)) + [1] * len(second)]
    input_ids = torch.tensor(rows)
    patch_dim = 3 * 2 * 4 * 4
    grids, video_grid = torch.tensor(IMAGE_GRIDS), torch.tensor([VIDEO_GRID])
    return {"input_ids": input_ids, "attention_mask": torch.tensor(masks),
            "mm_token_type_ids": (input_ids == IMAGE).long() + 2 * (input_ids == VIDEO).long(),
            "pixel_values": torch.randn(int(grids.prod(-1).sum()), patch_dim, generator=generator),
            "image_grid_thw": grids,
            "pixel_values_videos": torch.randn(int(video_grid.prod(-1).sum()), patch_dim, generator=generator),
            "video_grid_thw": video_grid}


@pytest.fixture(scope="module")
def world():
    with megatron_world() as backend:
        yield backend


@pytest.mark.parametrize("name", ["qwen2-vl-tiny", "qwen2.5-vl-tiny", "qwen3-vl-tiny", "qwen3-vl-moe-tiny"])
def test_images_and_a_video_in_one_batch_match_transformers(world, name):
    flavor = FLAVORS[name]
    config = _reference_config(name)
    reference = perturbed(getattr(transformers, flavor.hf_architecture)(config))
    ours = build_vlm(flavor, backend=world).eval()
    missing, unexpected = ours.load_state_dict(from_hf(reference.state_dict(), flavor), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    batch = _batch(flavor.timestamped_videos)
    extra = {"second_per_grid_ts": torch.tensor([SECONDS_PER_PATCH])} if flavor.tokens_per_second else {}
    with torch.no_grad():
        expected = reference(**batch, **extra).logits
        media = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        actual = ours(batch["input_ids"], attention_mask=batch["attention_mask"], **media,
                      **extra)[..., :flavor.foundation.vocab_size]
    keep = batch["attention_mask"].bool()
    assert expected[keep].std() > 0.5  # O(1) logits: the tolerance below means something
    diff = (actual - expected)[keep].abs().max().item()
    print(f"{name}: max abs logit diff {diff:.3g} over {int(keep.sum())} tokens")
    assert diff <= 1e-4


# -- video pixels and frame sampling against transformers' own code -----------------------------------------------
# transformers' Qwen video processors import torchvision at module level, which does not import beside this CPU
# torch (docs FACTS). Their frame sampling and patch layout are plain torch/numpy methods, so those methods are
# compiled here from transformers' installed source files, unchanged, and run on their own.


def _transformers_method(module: str, cls: str, method: str):
    """``cls.method`` of transformers' ``module`` (a dotted path under transformers.models), compiled from its source
    without importing the module."""
    import ast
    import math
    from pathlib import Path

    import numpy as np
    from transformers.video_utils import VideoMetadata

    path = Path(transformers.__file__).parent / "models" / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    node = next(n for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls for n in c.body
                if isinstance(n, ast.FunctionDef) and n.name == method)
    node.decorator_list = []
    namespace = {"torch": torch, "np": np, "math": math, "VideoMetadata": VideoMetadata}
    exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    return namespace[method]


@pytest.mark.parametrize(("rule", "total", "source_fps", "fps", "num_frames"), [
    ("qwen2", 30, 10.0, 2.0, None), ("qwen2", 37, 24.0, 3.0, None), ("qwen2", 9, 25.0, 2.0, None),
    ("qwen2", 50, 10.0, 1.5, None), ("qwen3", 50, 10.0, 1.5, None),
    ("qwen2", 41, 30.0, None, 7), ("qwen3", 30, 10.0, 2.0, None), ("qwen3", 47, 24.0, 3.0, None),
    ("qwen3", 5, 25.0, 2.0, None), ("qwen3", 41, 30.0, None, 7)])
def test_frame_sampling_equals_transformers(rule, total, source_fps, fps, num_frames):
    from types import SimpleNamespace

    from loongforge_vlm.data.video import FrameSampling, sample_indices
    from transformers.video_utils import VideoMetadata

    owner = "qwen2_vl.video_processing_qwen2_vl" if rule == "qwen2" else "qwen3_vl.video_processing_qwen3_vl"
    cls = "Qwen2VLVideoProcessor" if rule == "qwen2" else "Qwen3VLVideoProcessor"
    sample = _transformers_method(owner, cls, "sample_frames")
    defaults = SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=4, max_frames=768)
    metadata = VideoMetadata(total_num_frames=total, fps=source_fps)
    expected = [int(i) for i in sample(defaults, metadata, num_frames=num_frames, fps=fps if num_frames is None
                                       else None)]
    sampling = FrameSampling(fps=fps or 2.0, num_frames=num_frames, rule=rule)
    assert sample_indices(total, source_fps, sampling, 2) == expected


def test_video_rows_and_timestamps_equal_transformers():
    """Three frames (an odd count: the last repeats to fill the second temporal patch), resized and normalised as
    images are (tests/vlm/test_vlm_data_processor.py compares those with transformers), then laid out in patch rows:
    transformers' ``Qwen2VLVideoProcessor.patchify`` must give the same rows; Qwen3-VL's text times of the sampled
    frames equal its processor's ``_calculate_timestamps``."""
    import numpy as np
    from loongforge_vlm.data.processor import VisionProcessor, normalized_pixels, smart_resize
    from loongforge_vlm.data.video import patch_times
    from PIL import Image
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    generator = np.random.default_rng(0)
    frames = [Image.fromarray(generator.integers(0, 256, (37, 50, 3), dtype=np.uint8)) for _ in range(3)]
    ours = VisionProcessor(patch_size=4, merge_size=2, min_pixels=8 * 8, max_pixels=32 * 48)
    rows, grid = ours.video(frames)
    height, width = smart_resize(37, 50, 8, ours.min_pixels, ours.max_pixels)
    normalized = np.stack([normalized_pixels(f, width, height, "clip") for f in frames])  # [T, H, W, C]
    patchify = _transformers_method("qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor", "patchify")
    videos = torch.from_numpy(normalized).permute(0, 3, 1, 2)[None].contiguous()  # [B, T, C, H, W]
    theirs, t, h, w = patchify(None, videos, patch_size=4, merge_size=2, temporal_patch_size=2)
    assert grid == (t, h, w) == (2, height // 4, width // 4)
    assert np.array_equal(rows, theirs[0].numpy())
    indices = [0, 3, 6, 9, 13]
    assert patch_times(indices, 10.0, 2) == Qwen3VLProcessor._calculate_timestamps(None, indices, 10.0, 2)


# -- the video field of a record: files, GIFs, frame directories; errors; training ------------------------------


def _square_frames(count: int, seed: int, size: int = 32) -> list:
    """A white square moving right (seed even) or left across a dark frame."""
    import numpy as np
    from PIL import Image

    frames = []
    for k in range(count):
        pixels = np.full((size, size, 3), 20, dtype=np.uint8)
        x = 2 + 3 * k if seed % 2 == 0 else size - 10 - 3 * k
        pixels[12:20, x:x + 8] = 255
        frames.append(Image.fromarray(pixels))
    return frames


def _gif(frames, duration_ms: int) -> bytes:
    import io

    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=duration_ms, loop=0)
    return out.getvalue()


def _mp4(frames, fps: int) -> bytes:
    import io

    import av
    import numpy as np

    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames[0].width, frames[0].height, "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.asarray(frame), format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()


def _ask(answer: str) -> list[dict]:
    return [{"role": "user", "content": "<image>Which way does <video> move?"}, {"role": "assistant",
                                                                                 "content": answer}]


def test_video_files_gifs_and_frame_directories(tmp_path):
    """The same 8 frames as a GIF (10 fps from its durations), an mp4 clip (PyAV) and a frame directory give the
    frames sampled at ``fps``; ``num_frames`` keeps evenly spaced ones; Qwen3-VL's text gets a time per temporal
    patch and the model's tokens per patch. A missing file and a too-short clip are skipped with one line that
    names the sample and the file."""
    import io

    import numpy as np
    from loongforge.data.errors import DataError
    from loongforge_vlm.data.dataset import VisionChatDataset
    from loongforge_vlm.data.kind import byte_tokenizer_for, processor_for_vlm
    from loongforge_vlm.data.sources import JsonlSource
    from loongforge_vlm.data.tokens import VisionByteTokenizer
    from vlm_data_helpers import png, write_jsonl

    frames = _square_frames(8, 0)
    files = {"still.png": png(32, 32, 1), "clip.gif": _gif(frames, 100), "clip.mp4": _mp4(frames, 10),
             "short.gif": _gif(frames[:1], 100)}
    for k, frame in enumerate(frames):
        buffer = io.BytesIO()
        frame.save(buffer, format="PNG")
        files[f"frames/{k:02d}.png"] = buffer.getvalue()
    path = write_jsonl(tmp_path / "v.jsonl", [
        {"image": "still.png", "video": "clip.gif", "fps": 5, "messages": _ask("right")},   # 8 frames at 10 fps -> 4
        {"image": "still.png", "videos": ["clip.mp4"], "fps": 5, "messages": _ask("right")},
        {"image": "still.png", "video": "frames", "fps": 10, "num_frames": 4, "messages": _ask("right")},
        {"image": "still.png", "video": "missing.gif", "messages": _ask("right")},
        ], files)
    processor = processor_for_vlm(FLAVORS["qwen2-vl-tiny"], min_pixels=16 * 16, max_pixels=32 * 32)
    dataset = VisionChatDataset([JsonlSource(path)], VisionByteTokenizer(), processor)
    assert len(dataset) == 3 and dataset.skipped.counts == {"corrupt": 1}
    missing = f"{tmp_path / 'missing.gif'}: cannot be read (FileNotFoundError)"
    assert dataset.skipped.first["corrupt"] == missing
    short_record = {"image": "still.png", "video": "short.gif", "messages": _ask("right")}
    short = write_jsonl(tmp_path / "short.jsonl", [short_record], {})
    with pytest.raises(DataError) as error:
        VisionChatDataset([JsonlSource(short)], VisionByteTokenizer(), processor, strict=True)
    assert str(error.value).startswith(f"{tmp_path / 'short.gif'}: has 1 frame(s), too few to sample 2 (whole "
                                       f"temporal patches of 2) (a video of {short} line 1)")
    assert "\n" not in str(error.value)
    gif, mp4, folder = (dataset[i] for i in range(3))
    expected, grid = processor.video([frames[i] for i in (0, 2, 4, 6)])  # 8 frames at 10 fps, sampled at 5 fps
    assert gif.video_grid_thw.tolist() == folder.video_grid_thw.tolist() == [list(grid)] == [[2, 8, 8]]
    assert np.array_equal(gif.pixel_values_videos, expected)
    assert np.array_equal(folder.pixel_values_videos, expected)  # num_frames 4 of 8: the same frames
    assert np.abs(mp4.pixel_values_videos - expected).mean() < 0.1  # lossy codec, same frames
    assert gif.second_per_grid_ts.tolist() == pytest.approx([0.4])  # 2 frames 0.2 s apart per temporal patch
    assert gif.ids.tolist().count(VisionByteTokenizer().vision_tokens.video_pad) == 2 * 8 * 8 // 4

    qwen3 = FLAVORS["qwen3-vl-tiny"]
    stamped = VisionChatDataset([JsonlSource(path)], byte_tokenizer_for(qwen3),
                                processor_for_vlm(qwen3, min_pixels=16 * 16, max_pixels=32 * 32))
    text = bytes(i for i in stamped[0].ids.tolist() if i < 256).decode()
    # Qwen3-VL's rule keeps frames 0, 2, 5, 7 of 8 (linspace): temporal patches at 0.1 s and 0.6 s
    assert "Which way does <0.1 seconds><0.6 seconds> move?" in text
    assert stamped[0].ids.tolist().count(qwen3.video_token_id) == 2 * 8 * 8 // 4


def test_a_moving_square_clip_set_trains(world, tmp_path):
    """Qwen3-VL-tiny (timestamped frames, DeepStack at the video positions) on two GIF clips of a square moving
    left or right, each beside a still image: the loss of the answers falls over a few steps."""
    from loongforge_vlm.data.batching import split_rows
    from loongforge_vlm.data.dataset import VisionChatDataset
    from loongforge_vlm.data.kind import byte_tokenizer_for, processor_for_vlm
    from loongforge_vlm.data.sources import JsonlSource
    from vlm_data_helpers import png, write_jsonl

    flavor = FLAVORS["qwen3-vl-tiny"]
    files = {f"clip{k}.gif": _gif(_square_frames(6, k), 100) for k in range(2)}
    files["still.png"] = png(32, 32, 1)
    path = write_jsonl(tmp_path / "clips.jsonl", [
        {"image": "still.png", "video": f"clip{k}.gif", "fps": 10, "messages": _ask("right" if k % 2 == 0 else "left")}
        for k in range(2)], files)
    dataset = VisionChatDataset([JsonlSource(path)], byte_tokenizer_for(flavor),
                                processor_for_vlm(flavor, min_pixels=16 * 16, max_pixels=32 * 32))
    rows, _ = split_rows(dataset, 256, pack=True)
    batch = rows.batch(list(range(len(rows))))
    assert batch["video_grid_thw"].tolist() == [[3, 8, 8]] * 2
    torch.manual_seed(0)
    model = build_vlm(flavor, backend=world).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    inputs = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
    inputs["packed_seq_params"] = PackedRows.from_cu_seqlens(batch["cu_seqlens"], *batch["tokens"].shape)
    losses = []
    for _ in range(4):
        per_token = model(batch["tokens"], labels=batch["labels"], **inputs)
        loss = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print("losses", [round(x, 3) for x in losses])
    assert model.encoder.patch_embed.weight.grad.abs().sum() > 0  # the pixels take part
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.9 * losses[0]


@pytest.mark.parametrize("name", ["qwen2-vl-tiny", "qwen3-vl-tiny"])
def test_a_video_preference_pair_renders_its_prompt_as_a_training_sample(tmp_path, name):
    """A preference pair whose prompt holds a video reads to the tokens of the same conversation as an image-text
    sample (Qwen3-VL: a time per temporal patch, each patch its own run), the reply mask alike."""
    from loongforge_vlm.data.dataset import VisionChatDataset
    from loongforge_vlm.data.kind import byte_tokenizer_for, processor_for_vlm
    from loongforge_vlm.data.pairs import VisionPairDataset
    from loongforge_vlm.data.sources import JsonlSource
    from vlm_data_helpers import write_jsonl

    flavor = FLAVORS[name]
    tokenizer = byte_tokenizer_for(flavor)
    processor = processor_for_vlm(flavor, min_pixels=16 * 16, max_pixels=32 * 32)
    question = "Which way does <video> move?"
    pair = {"video": "clip.gif", "fps": 5, "prompt": question, "chosen": "right", "rejected": "left"}
    chat = {"video": "clip.gif", "fps": 5, "messages": _ask("right")[1:]}
    chat["messages"].insert(0, {"role": "user", "content": question})
    pairs = VisionPairDataset([JsonlSource(write_jsonl(tmp_path / "pairs.jsonl", [pair],
                                                       {"clip.gif": _gif(_square_frames(8, 0), 100)}))],
                              tokenizer, processor)
    chats = VisionChatDataset([JsonlSource(write_jsonl(tmp_path / "chat.jsonl", [chat], {}))], tokenizer, processor,
                              strict=True)
    chosen, sample = pairs.pairs[0].tokens.chosen, chats.entries[0].chat
    assert chosen.ids.tolist() == sample.ids.tolist()
    assert chosen.supervised.tolist() == sample.supervised.tolist()
    text = bytes(i for i in chosen.ids.tolist() if i < 256).decode()
    assert ("<0.1 seconds><0.6 seconds> move?" in text) == flavor.timestamped_videos
    assert chosen.ids.tolist().count(flavor.video_token_id) == 2 * 8 * 8 // 4
