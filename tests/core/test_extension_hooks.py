"""Tokenizers and parallel strategies registered by a plugin are what a config's names resolve to."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import sys
    from loongforge import hookimpl
    from loongforge.cli import main
    from loongforge.data.tokenizers import ByteTokenizer
    from loongforge.errors import ConfigError
    from loongforge.parallel.megatron import MegatronStrategy
    from loongforge.plugins import get_host

    class ShoutingTokenizer(ByteTokenizer):
        """Upper-cases text before encoding: visible in the dataset's tokenizer name and ids."""
        name = "shouting"
        def encode(self, text):
            print("shouting tokenizer used", flush=True) if not getattr(self, "_said", False) else None
            self._said = True
            return super().encode(text.upper())

    class SingleProcessStrategy(MegatronStrategy):
        name = "single"
        @staticmethod
        def validate(parallel, world_size, source="config"):
            if parallel.tp != 1:
                raise ConfigError(f"{source}: strategy 'single' runs without tensor parallelism")
            return MegatronStrategy.validate(parallel, world_size, source)

    class Extension:
        @hookimpl
        def loongforge_register_tokenizers(self, registry):
            registry.register("shouting", ShoutingTokenizer)

        @hookimpl
        def loongforge_register_parallel_strategies(self, registry):
            registry.register("single", SingleProcessStrategy)

    get_host().register(Extension(), "extension")
    sys.exit(main(sys.argv[1:]))
''')


def run(tmp_path, *overrides):
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(f"""
        run: {{output_dir: {tmp_path / 'out'}}}
        model: {{name: llama-debug}}
        parallel: {{strategy: single}}
        data: {{dataset: text, paths: [{tmp_path / 'doc.txt'}], tokenizer: shouting, seq_length: 16}}
        training: {{steps: 2, micro_batch_size: 2}}
        logging: {{progress: false, tensorboard: false}}
        checkpoint: {{save_at_end: false}}
    """))
    (tmp_path / "doc.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    env_cache = {"LOONGFORGE_CACHE_DIR": str(tmp_path / "cache")}
    import os

    return subprocess.run([sys.executable, "-c", SCRIPT, "train", str(config), *overrides],
                          capture_output=True, text=True, env={**os.environ, **env_cache})


def test_plugin_tokenizer_and_strategy_are_used(tmp_path):
    result = run(tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "shouting tokenizer used" in result.stdout


def test_plugin_strategy_validation_applies(tmp_path):
    result = run(tmp_path, "parallel.tp=2")
    assert result.returncode == 2
    assert "strategy 'single' runs without tensor parallelism" in result.stderr
