"""Trains the tiny Qwen3-Next-shaped model (mk_tiny.py) on English text shipped with
Python (pydoc_data.topics), target and MTP layer together, and writes MODEL_DIR/
model.safetensors in the checkpoint layout vLLM's Qwen3NextForCausalLM and Qwen3NextMTP
load (issue 42, item 3): served with real weights, the model answers any user message
with pydoc-like words, and MTP acceptance is a trained drafter's.

  python3 train_text.py MODEL_DIR [--seconds 150] [--device cuda] [--batch 32 --seq 1024]
  python3 train_text.py MODEL_DIR --check     # only check a written model.safetensors

MODEL_DIR holds config.json and the byte-level tokenizer from mk_tiny.py. The target is
transformers' Qwen3NextForCausalLM (its torch fallbacks for the Gated-DeltaNet kernels:
no fla / causal-conv1d needed); the MTP layer is built here as vLLM's
Qwen3NextMultiTokenPredictor computes it:

  e = pre_fc_norm_embedding(embed(x[t+1])); h = pre_fc_norm_hidden(H[t])
  m = norm(layer(fc(cat[e, h]), position t))   -> lm_head -> x[t+2]

where H is the target's last hidden state after its final norm (what
Qwen3NextForCausalLM.forward returns and the proposer passes on), the norms are
Qwen3-Next's (1 + w) RMSNorms, layer is a full-attention + MoE decoder layer, and embed /
lm_head are the target's. vLLM's second draft step feeds the MTP's own output (after
mtp.norm) back with the first draft token at position t + 1; that step is trained too.
"""

import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SPECIAL = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
IM_START, IM_END = SPECIAL["<|im_start|>"], SPECIAL["<|im_end|>"]


# -- the byte-level tokenizer of mk_tiny.py -------------------------------------------------
def byte_order():
    """mk_tiny.b2u()'s byte order: vocab id i is the byte order[i]."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    return bs + [b for b in range(256) if b not in bs]


ORDER = byte_order()
LUT = np.zeros(256, dtype=np.int64)  # byte -> token id
LUT[ORDER] = np.arange(256)
INV = np.array(ORDER, dtype=np.uint8)  # token id (< 256) -> byte


def enc(data):
    if isinstance(data, str):
        data = data.encode()
    return LUT[np.frombuffer(data, dtype=np.uint8)] if data else np.zeros(0, np.int64)


def dec(ids):
    ids = [int(i) for i in ids]
    out, inv = [], {v: k for k, v in SPECIAL.items()}
    run = []
    for i in ids:
        if i < 256:
            run.append(i)
            continue
        out.append(bytes(INV[run]).decode("utf-8", "replace"))
        run = []
        out.append(inv.get(i, f"<{i}>"))
    out.append(bytes(INV[run]).decode("utf-8", "replace"))
    return "".join(out)


def chat_prompt(user):
    """mk_tiny's chat template, one user turn, add_generation_prompt=True."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def verify_tokenizer(model_dir, texts):
    """The ids used here are what MODEL_DIR/tokenizer.json gives."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    for text in texts:
        got = tok.encode(text, add_special_tokens=False).ids
        want = encode_with_specials(text)
        if got != want:
            raise SystemExit(f"tokenizer mismatch on {text[:60]!r}: {got[:20]} vs {want[:20]}")
    print(f"tokenizer: {len(texts)} samples encode identically to tokenizer.json", flush=True)


def encode_with_specials(text):
    ids, rest = [], text
    while rest:
        hits = [(rest.find(s), s) for s in SPECIAL if rest.find(s) >= 0]
        if not hits:
            ids += enc(rest).tolist()
            break
        pos, s = min(hits)
        ids += [*enc(rest[:pos]).tolist(), SPECIAL[s]]
        rest = rest[pos + len(s) :]
    return ids


# -- the data: pydoc topics as chat answers and plain text ----------------------------------
class Corpus:
    def __init__(self, seed):
        from pydoc_data.topics import topics

        self.rng = random.Random(seed)
        self.docs = []  # (key, title, text bytes, paragraph starts)
        for key in sorted(topics):
            text = topics[key].replace("\r\n", "\n")
            title = text.split("\n", 1)[0].replace('"', "").strip() or key
            raw = text.encode()
            starts = [0] + [i + 2 for i in range(len(raw) - 2) if raw[i : i + 2] == b"\n\n"]
            self.docs.append((key, title, raw, starts))
        self.words = b" ".join(d[2] for d in self.docs).split()
        self.nbytes = sum(len(d[2]) for d in self.docs)

    def question(self, key, title, chunk):
        """(the user message, whether it is garbage)."""
        r = self.rng.random()
        name = key.replace("-", " ")
        t = title[0].lower() + title[1:] if title.startswith("The ") else title
        if r < 0.25:
            return f"Explain {t}.", False
        if r < 0.4:
            q = self.rng.choice([f"What is {name}?", f"Explain {name}.", f"Tell me about {t}."])
            return q, False
        if r < 0.55:  # the answer's first words
            words = chunk[:200].decode("utf-8", "replace").split()
            return " ".join(words[: self.rng.randint(2, 8)]), False
        if r < 0.65:  # random words of the corpus
            n = self.rng.randint(1, 60)
            q = b" ".join(self.rng.choice(self.words) for _ in range(n))
            return q.decode("utf-8", "replace"), False
        # Garbage, as vLLM's `bench serve` random prompts are: random byte-level tokens,
        # decoded (invalid UTF-8 -> U+FFFD) and re-encoded.
        n = self.rng.choice([self.rng.randint(1, 64), self.rng.randint(64, 700)])
        junk = self.rng.randbytes(n).decode("utf-8", "replace")
        for s in SPECIAL:
            junk = junk.replace(s, "")
        return junk, True

    def chunk(self, raw, starts, from_top, lo, hi):
        start = 0 if from_top else self.rng.choice(starts)
        piece = raw[start : start + self.rng.randint(lo, hi)]
        # End at a sentence or line end (else a word end) so <|im_end|> follows whole text.
        for sep in (b".\n", b". ", b"\n", b" "):
            cut = piece.rfind(sep)
            if cut > len(piece) // 3:
                return piece[: cut + (1 if sep != b" " else 0)].rstrip()
        return piece.decode("utf-8", "ignore").encode()  # no split character

    def sample(self):
        """(token ids, loss weights): a chat turn (80%) or plain text."""
        key, title, raw, starts = self.rng.choice(self.docs)
        if self.rng.random() < 0.2:
            ids = enc(self.chunk(raw, starts, False, 200, 2000) + b"\n\n")
            return ids, np.ones(len(ids), np.float32)
        from_top = self.rng.random() < 0.5
        answer = self.chunk(raw, starts, from_top, 80, 600)
        q, garbage = self.question(key, title, answer)
        head = np.concatenate([[IM_START], enc("user\n")])
        user = enc(q)
        tail = np.concatenate(
            [[IM_END], enc("\n"), [IM_START], enc("assistant\n"), enc(answer), [IM_END], enc("\n")]
        )
        ids = np.concatenate([head, user, tail]).astype(np.int64)
        w = np.ones(len(ids), np.float32)
        if garbage:  # no loss on predicting garbage
            w[len(head) : len(head) + len(user)] = 0.0
        return ids, w

    def row(self, n):
        ids, ws = [], []
        size = 0
        while size < n:
            i, w = self.sample()
            ids.append(i)
            ws.append(w)
            size += len(i)
        return np.concatenate(ids)[:n], np.concatenate(ws)[:n]

    def batch(self, b, n):
        rows = [self.row(n) for _ in range(b)]
        return (
            torch.from_numpy(np.stack([r[0] for r in rows])),
            torch.from_numpy(np.stack([r[1] for r in rows])),
        )


# -- the model: transformers' target + the MTP layer as vLLM runs it ------------------------
def build(model_dir, experts):
    from transformers import AutoConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    cfg = AutoConfig.from_pretrained(model_dir)
    model = Qwen3NextForCausalLM._from_config(
        cfg, attn_implementation="sdpa", experts_implementation=experts, dtype=torch.float32
    )  # float32 master weights (config.json says bfloat16: what vLLM serves)

    class MTP(nn.Module):
        """vLLM's Qwen3NextMultiTokenPredictor (qwen3_next_mtp.py), its checkpoint names."""

        def __init__(self):
            super().__init__()
            h, eps = cfg.hidden_size, cfg.rms_norm_eps
            self.fc = nn.Linear(2 * h, h, bias=False)
            # vLLM builds it with layer_type="full_attention" and MoE (mlp_only_layers = []).
            full = cfg.layer_types.index("full_attention")
            self.layers = nn.ModuleList(
                [hf.Qwen3NextDecoderLayer(cfg, full) for _ in range(cfg.num_nextn_predict_layers)]
            )
            self.norm = hf.Qwen3NextRMSNorm(h, eps=eps)
            self.pre_fc_norm_hidden = hf.Qwen3NextRMSNorm(h, eps=eps)
            self.pre_fc_norm_embedding = hf.Qwen3NextRMSNorm(h, eps=eps)

        def forward(self, embeds, hidden, position_embeddings, step=0):
            x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1)
            x = self.fc(x)
            layer = self.layers[step % len(self.layers)]
            x = layer(x, position_embeddings=position_embeddings, attention_mask=None)
            if isinstance(x, tuple):
                x = x[0]
            return self.norm(x)

    mtp = MTP()
    for m in mtp.modules():  # the target's own initialisation
        model._init_weights(m)
    return cfg, model, mtp


def mtp_pass(model, mtp, hidden, ids, offset, step):
    """hidden[:, t] (target's or the previous MTP step's) with embed(ids[:, t]) at position
    t + offset -> the MTP hidden state."""
    pos = torch.arange(offset, offset + ids.shape[1], device=ids.device)[None]
    pe = model.model.rotary_emb(hidden, pos)
    return mtp(model.model.embed_tokens(ids), hidden, pe, step)


def losses(model, mtp, x, w, mtp_steps):
    """x: (B, T + 1) tokens, w: their loss weights. Main loss predicts x[t+1]; MTP step k
    (1-based) predicts x[t+1+k]."""
    T = x.shape[1] - 1
    h = model.model(input_ids=x[:, :T], use_cache=False).last_hidden_state

    def ce(hs, k):  # hs[:, t] predicts x[:, t + k]
        tgt = x[:, k : k + hs.shape[1]]
        wt = w[:, k : k + hs.shape[1]]
        logits = model.lm_head(hs).float()
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none"
        )
        return (loss * wt.reshape(-1)).sum() / wt.sum().clamp(min=1)

    out = [ce(h, 1)]
    prev = h
    for k in range(mtp_steps):
        # step k: hidden at t (t < T - k - 1), token x[t + 1 + k], position t + k
        n = T - 1 - k
        m = mtp_pass(model, mtp, prev[:, :n], x[:, 1 + k : 1 + k + n], k, 0)
        out.append(ce(m, 2 + k))
        prev = m
    return out


# -- the checkpoint -------------------------------------------------------------------------
def checkpoint(model, mtp):
    """Tensors under the names of Qwen3-Next's checkpoints (what vLLM loads): per-expert
    mlp.experts.{e}.gate_proj/up_proj/down_proj.weight, MTP under mtp.*."""
    out = {}

    def put(prefix, sd):
        for k, v in sd.items():
            name = prefix + k
            v = v.detach()
            if name.endswith("mlp.experts.gate_up_proj"):  # (E, 2I, H): gate rows, then up
                base, inter = name[: -len("gate_up_proj")], v.shape[1] // 2
                for e in range(v.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = v[e, :inter]
                    out[f"{base}{e}.up_proj.weight"] = v[e, inter:]
            elif name.endswith("mlp.experts.down_proj") and v.dim() == 3:  # (E, H, I)
                base = name[: -len("down_proj")]
                for e in range(v.shape[0]):
                    out[f"{base}{e}.down_proj.weight"] = v[e]
            elif "rotary_emb" not in name:
                out[name] = v

    put("", model.state_dict())
    put("mtp.", mtp.state_dict())
    return {k: v.to("cpu", torch.bfloat16).contiguous() for k, v in out.items()}


def expected_shapes(cfg):
    """The checkpoint vLLM's loaders take for this config, by name (from vLLM's model source:
    Qwen3NextModel / Qwen3NextMultiTokenPredictor, Qwen3-Next's checkpoint layout)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    ad, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h)}
    shapes["model.norm.weight"] = (h,)

    def layer(p, kind):
        if kind == "linear_attention":
            a = p + "linear_attn."
            shapes.update(
                {
                    a + "in_proj_qkvz.weight": (2 * kd + 2 * vd, h),
                    a + "in_proj_ba.weight": (2 * cfg.linear_num_value_heads, h),
                    a + "conv1d.weight": (2 * kd + vd, 1, cfg.linear_conv_kernel_dim),
                    a + "A_log": (cfg.linear_num_value_heads,),
                    a + "dt_bias": (cfg.linear_num_value_heads,),
                    a + "norm.weight": (cfg.linear_value_head_dim,),
                    a + "out_proj.weight": (h, vd),
                }
            )
        else:
            a = p + "self_attn."
            shapes.update(
                {
                    a + "q_proj.weight": (2 * ad, h),  # query and its output gate
                    a + "k_proj.weight": (kvd, h),
                    a + "v_proj.weight": (kvd, h),
                    a + "o_proj.weight": (h, ad),
                    a + "q_norm.weight": (cfg.head_dim,),
                    a + "k_norm.weight": (cfg.head_dim,),
                }
            )
        m, i, s = p + "mlp.", cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        shapes.update(
            {m + "gate.weight": (cfg.num_experts, h), m + "shared_expert_gate.weight": (1, h)}
        )
        for e in range(cfg.num_experts):
            shapes.update(
                {
                    f"{m}experts.{e}.gate_proj.weight": (i, h),
                    f"{m}experts.{e}.up_proj.weight": (i, h),
                    f"{m}experts.{e}.down_proj.weight": (h, i),
                }
            )
        shapes.update(
            {
                m + "shared_expert.gate_proj.weight": (s, h),
                m + "shared_expert.up_proj.weight": (s, h),
                m + "shared_expert.down_proj.weight": (h, s),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )

    for n, kind in enumerate(cfg.layer_types):
        layer(f"model.layers.{n}.", kind)
    for n in range(cfg.num_nextn_predict_layers):
        layer(f"mtp.layers.{n}.", "full_attention")
    shapes.update(
        {
            "mtp.fc.weight": (h, 2 * h),
            "mtp.norm.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.pre_fc_norm_embedding.weight": (h,),
        }
    )
    return shapes


def vllm_load(model_dir, tensors):
    """Builds vLLM's own Qwen3NextForCausalLM and Qwen3NextMTP for MODEL_DIR (on the CPU where
    vLLM is the CPU build) and loads TENSORS with their load_weights: every parameter loaded,
    no name refused, fused tensors assembled as expected. Returns problems, or raises
    ImportError / RuntimeError where vLLM can't be set up here."""
    import socket

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
        from vllm.model_executor.models.qwen3_next_mtp import Qwen3NextMTP

        vc = EngineArgs(
            model=model_dir,
            load_format="dummy",
            dtype="bfloat16",
            max_model_len=1024,
            enforce_eager=True,
            speculative_config={"method": "mtp", "num_speculative_tokens": 2},
            # run.sh's kernels on a GPU (the bundle has no FlashAttention)
            **(
                {"attention_backend": "TRITON_ATTN", "gdn_prefill_backend": "triton"}
                if torch.cuda.is_available()
                else {}
            ),
        ).create_engine_config()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(vc):
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{port}",
            )
            initialize_model_parallel(1, 1)
            models = {
                "Qwen3NextForCausalLM": Qwen3NextForCausalLM(vllm_config=vc, prefix=""),
                "Qwen3NextMTP": Qwen3NextMTP(vllm_config=vc, prefix=""),
            }
    except Exception as e:
        raise RuntimeError(f"vLLM's model classes could not be imported or built: {e!r}") from e
    problems = []
    for cls, m in models.items():
        m = m.to(torch.float32)
        try:
            loaded = m.load_weights(iter(tensors.items()))
        except Exception as e:
            problems.append(f"{cls}.load_weights raised {e!r}")
            continue
        params = dict(m.named_parameters())
        missing = sorted(set(params) - set(loaded))
        if missing:
            problems.append(f"{cls}: not loaded {missing}")
        # The fused parameters hold the checkpoint tensors in the expected order.
        for name, p in params.items():
            base = name  # its checkpoint name
            if cls == "Qwen3NextMTP" and name.startswith("model.") and "embed_tokens" not in name:
                base = "mtp." + name[len("model.") :]
            layer = base.split(".mlp.")[0].split(".self_attn.")[0]
            want = None
            if name.endswith("w13_weight"):  # (E, 2I, H): gate, then up
                want = torch.stack(
                    [
                        torch.cat(
                            [
                                tensors[f"{layer}.mlp.experts.{e}.gate_proj.weight"],
                                tensors[f"{layer}.mlp.experts.{e}.up_proj.weight"],
                            ]
                        )
                        for e in range(p.shape[0])
                    ]
                )
            elif name.endswith("w2_weight"):
                want = torch.stack(
                    [
                        tensors[f"{layer}.mlp.experts.{e}.down_proj.weight"]
                        for e in range(p.shape[0])
                    ]
                )
            elif name.endswith("self_attn.qkv_proj.weight"):
                want = torch.cat([tensors[f"{layer}.self_attn.{x}_proj.weight"] for x in "qkv"])
            elif name.endswith("shared_expert.gate_up_proj.weight"):
                want = torch.cat(
                    [tensors[f"{layer}.mlp.shared_expert.{x}_proj.weight"] for x in ("gate", "up")]
                )
            elif base in tensors:
                want = tensors[base]
            if want is None:
                problems.append(f"{cls}: no source known for {name} (check by hand)")
            elif tuple(want.shape) != tuple(p.shape) or not torch.equal(
                want.float(), p.detach().float().cpu()
            ):
                problems.append(f"{cls}: {name} does not hold the checkpoint's values")
        print(
            f"vLLM {cls}.load_weights: {len(loaded)} of {len(params)} parameters loaded", flush=True
        )
    return problems


def check(model_dir, use_vllm=True):
    """Compares MODEL_DIR/model.safetensors with what vLLM loads; True when it matches."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    want = expected_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    ok = True
    if got != want:
        ok = False
        for k in sorted(set(want) | set(got)):
            if want.get(k) != got.get(k):
                print(f"check: {k}: expected {want.get(k)}, written {got.get(k)}", flush=True)
    print(
        f"check: {len(got)} tensors, names and shapes {'as' if ok else 'NOT as'} expected",
        flush=True,
    )
    if not use_vllm:
        return ok
    try:
        problems = vllm_load(model_dir, tensors)
    except (ImportError, RuntimeError) as e:
        print(f"check: vLLM's loaders not run ({e}); names and shapes only", flush=True)
        return ok
    for p in problems:
        print("check: vLLM:", p, flush=True)
    print(
        f"check: vLLM's loaders {'accept' if not problems else 'REFUSE'} the checkpoint", flush=True
    )
    return ok and not problems


# -- samples --------------------------------------------------------------------------------
@torch.no_grad()
def greedy(model, mtp, prompt_ids, n, device):
    """Greedy continuation (no cache: recomputes, short), and MTP's greedy acceptance along it:
    step 1 (draft x[t+2] from H[t], x[t+1]) and step 2 given step 1's input right."""
    ids = list(prompt_ids)
    for _ in range(n):
        x = torch.tensor([ids], device=device)
        nxt = int(model(input_ids=x, use_cache=False).logits[0, -1].argmax())
        ids.append(nxt)
        if nxt == IM_END:
            break
    x = torch.tensor([ids], device=device)
    h = model.model(input_ids=x, use_cache=False).last_hidden_state
    p = len(prompt_ids) - 1  # H[p] predicts the first generated token
    acc = []
    prev = h
    for k in range(2):
        n_ = x.shape[1] - 2 - k  # the last positions have no token to check against
        m = mtp_pass(model, mtp, prev[:, :n_], x[:, 1 + k : 1 + k + n_], k, 0)
        pred = model.lm_head(m).argmax(-1)[0]
        tgt = x[0, 2 + k : 2 + k + n_]
        sel = slice(p, n_)  # the drafts made once the prompt is in: H[p] on
        hits = (pred[sel] == tgt[sel]).float()
        acc.append(float(hits.mean()) if hits.numel() else float("nan"))
        prev = m
    return dec(ids[len(prompt_ids) :]), acc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--seconds", type=float, default=150.0, help="training wall-clock budget")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024, help="tokens per row (bench prompts: ~550)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30, help="warmup steps")
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--mtp-steps", type=int, default=2, help="draft steps trained (run.sh: 2)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", default="eager", help="transformers experts_implementation")
    ap.add_argument("--sample-tokens", type=int, default=64)
    ap.add_argument("--check", action="store_true", help="only check MODEL_DIR/model.safetensors")
    ap.add_argument("--no-vllm-check", action="store_true")
    a = ap.parse_args()
    if a.check:
        sys.exit(0 if check(a.model_dir, not a.no_vllm_check) else 1)

    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.cuda.manual_seed_all(a.seed)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    import transformers

    corpus = Corpus(a.seed)
    probe = Corpus(a.seed + 3)
    verify_tokenizer(
        a.model_dir,
        [dec(probe.sample()[0]) for _ in range(200)] + [chat_prompt("Explain the with statement.")],
    )
    _, model, mtp = build(a.model_dir, a.experts)
    model.to(dev).train()
    mtp.to(dev).train()
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, {dev}"
        f"{' ' + torch.cuda.get_device_name(dev) if dev.type == 'cuda' else ''}; "
        f"params target {n_main / 1e6:.2f}M + MTP {n_mtp / 1e6:.2f}M; corpus "
        f"{len(corpus.docs)} pydoc topics, {corpus.nbytes / 1e3:.0f} KB; batch {a.batch} x "
        f"{a.seq}",
        flush=True,
    )

    params = list(model.parameters()) + list(mtp.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
        fused=dev.type == "cuda",
    )
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else None

    def lr_at(step, elapsed):  # linear warmup, cosine to 10% over the time budget
        progress = min(elapsed / a.seconds, 1.0)
        return (
            a.lr
            * min(1.0, (step + 1) / a.warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        )

    t0 = time.time()
    step, acc, first = 0, None, None
    toks_since, t_log = 0, t0
    while True:
        elapsed = time.time() - t0
        if elapsed >= a.seconds:
            break
        x, w = corpus.batch(a.batch, a.seq + 1)
        x, w = x.to(dev, non_blocking=True), w.to(dev, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, elapsed)
        if amp is not None:
            with amp:
                ls = losses(model, mtp, x, w, a.mtp_steps)
        else:
            ls = losses(model, mtp, x, w, a.mtp_steps)
        loss = ls[0] + a.mtp_weight * sum(ls[1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        toks_since += a.batch * a.seq
        cur = torch.stack([v.detach() for v in ls])
        acc = cur if acc is None else acc + cur
        if step == 1 or step % a.log_every == 0:
            vals = (acc / (1 if step == 1 else a.log_every)).tolist()
            now = time.time()
            if first is None:
                first = vals
            print(
                f"step {step:5d} {now - t0:6.1f}s lr {lr_at(step, now - t0):.2e} loss "
                f"{vals[0]:.3f} mtp "
                + " ".join(f"{v:.3f}" for v in vals[1:])
                + f"  {toks_since / (now - t_log):,.0f} tok/s",
                flush=True,
            )
            acc, toks_since, t_log = None, 0, now
    total = time.time() - t0
    print(
        f"trained {step} steps in {total:.0f}s ({step * a.batch * a.seq / total:,.0f} tok/s, "
        f"{step * a.batch * a.seq / corpus.nbytes:.1f} passes over the corpus' bytes)",
        flush=True,
    )

    # The weights as written (bf16), so that the losses and samples below are the served model's.
    with torch.no_grad():
        for p in params:
            p.copy_(p.to(torch.bfloat16).float())
    model.eval()
    mtp.eval()
    with torch.no_grad():
        held = Corpus(a.seed + 1)
        evals = []
        for _ in range(4):
            x, w = held.batch(min(a.batch, 8), a.seq + 1)
            with amp or torch.autocast("cpu", enabled=False):
                evals.append(torch.stack(losses(model, mtp, x.to(dev), w.to(dev), a.mtp_steps)))
        ev = torch.stack(evals).mean(0).tolist()
    print(
        f"final loss (fresh samples, bf16 weights): {ev[0]:.3f} mtp "
        + " ".join(f"{v:.3f}" for v in ev[1:])
        + f" (first step: {first[0]:.3f} mtp "
        + " ".join(f"{v:.3f}" for v in first[1:])
        + ")",
        flush=True,
    )

    tensors = checkpoint(model, mtp)
    from safetensors.torch import save_file

    path = os.path.join(a.model_dir, "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(a.model_dir, "train_text.json"), "w") as f:
        json.dump({"steps": step, "seconds": total, "final_loss": ev, "args": vars(a)}, f)
    print(f"wrote {path}: {len(tensors)} tensors, {os.path.getsize(path) / 1e6:.1f} MB", flush=True)

    junk = random.Random(a.seed + 2).randbytes(300).decode("utf-8", "replace")
    for label, prompt in [
        ("garbage user message", encode_with_specials(chat_prompt(junk))),
        (
            "Explain the with statement.",
            encode_with_specials(chat_prompt("Explain the with statement.")),
        ),
        ("completion 'Open the settings page and'", enc("Open the settings page and").tolist()),
    ]:
        with amp or torch.autocast("cpu", enabled=False):
            text, acc2 = greedy(model, mtp, prompt, a.sample_tokens, dev)
        print(
            f"sample [{label}] (MTP greedy acceptance: step 1 {acc2[0]:.0%}, step 2 {acc2[1]:.0%}):"
            f"\n  {text!r}",
            flush=True,
        )
    sys.exit(0 if check(a.model_dir, not a.no_vllm_check) else 1)


if __name__ == "__main__":
    main()
