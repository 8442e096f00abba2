"""Build a tiny Llama-architecture model that vLLM's CPU build can serve.

Run with the vLLM virtualenv's Python (it needs torch, tokenizers, safetensors):

    python tests/support/build_tiny_model.py OUT_DIR

* A byte-level BPE tokenizer trained locally, so token id 0 is ``!`` exactly as in
  Qwen and Llama-3 vocabularies (what NaN logits decode to).
* Small seeded random weights (std 0.2), so each prompt gets its own greedy
  answer and a cache-hit answer equals a salted full prefill byte for byte.
* The lm_head rows of EOS and of token 0 are zero, so a clean server never emits
  ``!`` or an empty answer on its own: in the tests those come only from the
  poisoning scheduler.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = [
    "click",
    "tap",
    "type",
    "scroll",
    "open",
    "close",
    "button",
    "window",
    "menu",
    "file",
    "edit",
    "view",
    "help",
    "search",
    "settings",
    "profile",
    "account",
    "login",
    "logout",
    "submit",
    "cancel",
    "save",
    "delete",
    "next",
    "back",
    "home",
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "on",
    "at",
    "for",
    "with",
    "from",
    "by",
    "and",
    "or",
    "not",
    "is",
    "are",
    "was",
    "were",
    "be",
    "this",
    "that",
    "screen",
    "image",
    "page",
    "link",
    "field",
    "form",
    "list",
    "item",
    "table",
    "row",
    "column",
    "value",
    "name",
    "date",
    "time",
    "user",
    "agent",
    "task",
    "step",
    "goal",
    "done",
    "result",
    "error",
    "ok",
    "yes",
    "no",
    "true",
    "false",
    "null",
    "left",
    "right",
    "top",
    "bottom",
    "center",
    "x",
    "y",
    "width",
    "height",
    "first",
    "second",
    "third",
    "action",
    "select",
    "drag",
    "drop",
    "scroll_down",
    "scroll_up",
    "wait",
    "press",
    "enter",
    "escape",
    "tab",
    "shift",
    "ctrl",
    "alt",
    "key",
    "text",
    "input",
]
SPECIALS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus(rng: random.Random, lines: int = 4000) -> list[str]:
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(f"({rng.randint(0, 1920)}, {rng.randint(0, 1080)})")
        if rng.random() < 0.2:
            words.append(json.dumps({"action": rng.choice(WORDS), "x": rng.randint(0, 999)}))
        out.append(" ".join(words) + rng.choice([".", "!", "?", ",", ";", ":"]))
    return out


def build_tokenizer(out: Path, rng: random.Random) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(rng), trainer=trainer)
    tokenizer.add_special_tokens(SPECIALS)
    assert tokenizer.id_to_token(0) == "!", tokenizer.id_to_token(0)
    tokenizer.save(str(out / "tokenizer.json"))
    eos_id = tokenizer.token_to_id("<|endoftext|>")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": 4096,
                "chat_template": CHAT_TEMPLATE,
                "add_bos_token": False,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    )
    return eos_id


def build_weights(out: Path, vocab: int, eos_id: int, config: dict[str, int | float]) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(1234)
    hidden = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config["num_key_value_heads"])
    head_dim = int(config["head_dim"])

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    tensors = {
        "model.embed_tokens.weight": rand(vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for layer in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    lm_head = rand(vocab, hidden)
    lm_head[0] = 0.0  # "!" never wins on a clean server...
    lm_head[eos_id] = 0.0  # ...and neither does EOS (no legitimately empty answers)
    tensors["lm_head.weight"] = lm_head
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(42)
    eos_id = build_tokenizer(out, rng)
    vocab = 1024 + len(SPECIALS)
    config: dict[str, int | float] = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
    }
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                **config,
                "vocab_size": vocab,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
                "torch_dtype": "float32",
                "bos_token_id": eos_id,
                "eos_token_id": eos_id,
                "hidden_act": "silu",
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))
    build_weights(out, vocab, eos_id, config)
    print(f"tiny model written to {out} (vocab {vocab}, eos {eos_id})")


if __name__ == "__main__":
    main(sys.argv[1])
