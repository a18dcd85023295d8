"""A tiny decoder-only LLM made offline, as onnxruntime-genai's model builder lays one out: genai's default input and
output names (input_ids, attention_mask, position_ids, past_key_values.N.key/value; logits, present.N.key/value),
com.microsoft GroupQueryAttention fed seqlens_k and total_sequence_length from the attention mask, a KV cache that
genai shares between past and present (past_present_share_buffer), random weights, and a genai_config.json beside
it. No tokenizer: tests feed token ids (`generator.append_tokens`).

    folder = llm_fixture.write(tmp_path)          # model.onnx + genai_config.json, well under a second
    tokens = llm_fixture.greedy(folder, prompt)   # genai in process, ORT's CPU EP
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"


@dataclass(frozen=True)
class Shape:
    """The decoder's sizes. The defaults make a KV cache of 128 KiB at a context of 128 (2 layers x key and
    value x 2 heads x 128 positions x 16 floats x 4 bytes): the issue's figures are for this one."""

    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_size: int = 16
    vocab: int = 256
    context: int = 1024  # the model's context_length: genai's max_length may not exceed it
    position_ids: bool = True  # rotary embedding by position_ids (RotaryEmbedding) or inside GQA (do_rotary)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_size

    def kv_bytes(self, max_length: int) -> int:
        """Bytes of the whole KV cache at max_length (every layer's key and value, float32)."""
        return self.layers * 2 * self.kv_heads * max_length * self.head_size * 4


def model(shape: Shape = Shape(), seed: int = 0) -> onnx.ModelProto:
    s = shape
    rng = np.random.default_rng(seed)
    inits: list[TensorProto] = []

    def weight(name: str, *dims: int, scale: float = 0.5) -> str:
        inits.append(numpy_helper.from_array((rng.standard_normal(dims) * scale).astype(np.float32), name))
        return name

    def const(name: str, value, dtype=np.int64) -> str:
        inits.append(numpy_helper.from_array(np.array(value, dtype), name))
        return name

    nodes = []

    def node(op: str, inputs: list[str], outputs: list[str], name: str, domain: str = "", **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain or None, **attrs))
        return outputs[0]

    # the attention mask as GroupQueryAttention takes it (the builder's attn_mask_reformat subgraph)
    one, axis1 = const("/model/constants/one", 1), const("/model/constants/axis1", [1])
    summed = node("ReduceSum", ["attention_mask", axis1], ["/model/attn_mask_reformat/ReduceSum/output_0"],
                  "/model/attn_mask_reformat/ReduceSum", keepdims=1)
    minus = node("Sub", [summed, one], ["/model/attn_mask_reformat/Sub/output_0"], "/model/attn_mask_reformat/Sub")
    seqlens_k = node("Cast", [minus], ["/model/attn_mask_reformat/Sub/Cast/output_0"],
                     "/model/attn_mask_reformat/Sub/Cast", to=TensorProto.INT32)
    mask_shape = node("Shape", ["attention_mask"], ["/model/attn_mask_reformat/Shape/output_0"],
                      "/model/attn_mask_reformat/Shape")
    total = node("Gather", [mask_shape, one], ["/model/attn_mask_reformat/Gather/output_0"],
                 "/model/attn_mask_reformat/Gather", axis=0)
    total_len = node("Cast", [total], ["/model/attn_mask_reformat/Gather/Cast/output_0"],
                     "/model/attn_mask_reformat/Gather/Cast", to=TensorProto.INT32)

    # rotary caches: [context, head_size / 2]
    inv = 1.0 / (10000 ** (np.arange(0, s.head_size, 2, dtype=np.float32) / s.head_size))
    angles = np.outer(np.arange(s.context, dtype=np.float32), inv)
    inits.append(numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos_cache"))
    inits.append(numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin_cache"))

    # embeddings small beside the layers' weights: each token depends on those before it (through the KV cache)
    x = node("Gather", [weight("model.embed_tokens.weight", s.vocab, s.hidden, scale=0.3), "input_ids"],
             ["/model/embed_tokens/Gather/output_0"], "/model/embed_tokens/Gather")
    for i in range(s.layers):
        p = f"/model/layers.{i}"
        normed = node("LayerNormalization", [x, weight(f"model.layers.{i}.input_layernorm.weight", s.hidden,
                                                       scale=0.1)],
                      [f"{p}/input_layernorm/output_0"], f"{p}/input_layernorm", axis=-1, epsilon=1e-5)
        q = node("MatMul", [normed, weight(f"model.layers.{i}.attn.q_proj.weight", s.hidden, s.hidden)],
                 [f"{p}/attn/q_proj/MatMul/output_0"], f"{p}/attn/q_proj/MatMul")
        k = node("MatMul", [normed, weight(f"model.layers.{i}.attn.k_proj.weight", s.hidden,
                                           s.kv_heads * s.head_size)],
                 [f"{p}/attn/k_proj/MatMul/output_0"], f"{p}/attn/k_proj/MatMul")
        v = node("MatMul", [normed, weight(f"model.layers.{i}.attn.v_proj.weight", s.hidden,
                                           s.kv_heads * s.head_size)],
                 [f"{p}/attn/v_proj/MatMul/output_0"], f"{p}/attn/v_proj/MatMul")
        if s.position_ids:
            q = node("RotaryEmbedding", [q, "position_ids", "cos_cache", "sin_cache"],
                     [f"{p}/attn/q_rotary/output_0"], f"{p}/attn/q_rotary", MS, interleaved=0, num_heads=s.heads)
            k = node("RotaryEmbedding", [k, "position_ids", "cos_cache", "sin_cache"],
                     [f"{p}/attn/k_rotary/output_0"], f"{p}/attn/k_rotary", MS, interleaved=0,
                     num_heads=s.kv_heads)
            rotary = ["", ""]
            gqa_attrs = {}
        else:
            rotary = ["cos_cache", "sin_cache"]
            gqa_attrs = {"do_rotary": 1, "rotary_interleaved": 0}
        attn = node("GroupQueryAttention",
                    [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens_k, total_len,
                     *rotary],
                    [f"{p}/attn/GroupQueryAttention/output_0", f"present.{i}.key", f"present.{i}.value"],
                    f"{p}/attn/GroupQueryAttention", MS, num_heads=s.heads, kv_num_heads=s.kv_heads,
                    scale=float(1 / np.sqrt(s.head_size)), local_window_size=-1, **gqa_attrs)
        o = node("MatMul", [attn, weight(f"model.layers.{i}.attn.o_proj.weight", s.hidden, s.hidden)],
                 [f"{p}/attn/o_proj/MatMul/output_0"], f"{p}/attn/o_proj/MatMul")
        x = node("Add", [x, o], [f"{p}/attn/residual/output_0"], f"{p}/attn/residual")
        up = node("MatMul", [x, weight(f"model.layers.{i}.mlp.up_proj.weight", s.hidden, 2 * s.hidden)],
                  [f"{p}/mlp/up_proj/MatMul/output_0"], f"{p}/mlp/up_proj/MatMul")
        act = node("Relu", [up], [f"{p}/mlp/act/output_0"], f"{p}/mlp/act")
        down = node("MatMul", [act, weight(f"model.layers.{i}.mlp.down_proj.weight", 2 * s.hidden, s.hidden)],
                    [f"{p}/mlp/down_proj/MatMul/output_0"], f"{p}/mlp/down_proj/MatMul")
        x = node("Add", [x, down], [f"{p}/mlp/residual/output_0"], f"{p}/mlp/residual")
    normed = node("LayerNormalization", [x, weight("model.norm.weight", s.hidden, scale=0.1)],
                  ["/model/norm/output_0"], "/model/norm", axis=-1, epsilon=1e-5)
    node("MatMul", [normed, weight("lm_head.weight", s.hidden, s.vocab, scale=1.0)], ["logits"],
         "/lm_head/MatMul")

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    kv = ["batch_size", s.kv_heads, "past_sequence_length", s.head_size]
    present = ["batch_size", s.kv_heads, "total_sequence_length", s.head_size]
    inputs = [helper.make_tensor_value_info("input_ids", i64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", i64, ["batch_size", "total_sequence_length"])]
    if s.position_ids:
        inputs.append(helper.make_tensor_value_info("position_ids", i64, ["batch_size", "sequence_length"]))
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch_size", "sequence_length", s.vocab])]
    for i in range(s.layers):
        inputs += [helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", f32, kv) for kind in ("key", "value")]
        outputs += [helper.make_tensor_value_info(f"present.{i}.{kind}", f32, present) for kind in ("key", "value")]
    graph = helper.make_graph(nodes, "tiny_decoder", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)],
                             ir_version=9)


def config(shape: Shape = Shape(), max_length: int = 128, provider_options: list | None = None) -> dict:
    """genai_config.json for the model: greedy search, the KV cache shared between past and present."""
    s = shape
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask",
              "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    if s.position_ids:
        inputs["position_ids"] = "position_ids"
    return {
        "model": {
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "type": "llama", "vocab_size": s.vocab,
            "context_length": s.context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": provider_options or []},
                "filename": "model.onnx", "head_size": s.head_size, "hidden_size": s.hidden,
                "num_attention_heads": s.heads, "num_hidden_layers": s.layers, "num_key_value_heads": s.kv_heads,
                "inputs": inputs,
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
            },
        },
        "search": {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": max_length,
                   "min_length": 0, "past_present_share_buffer": True, "early_stopping": True,
                   "length_penalty": 1.0, "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }


def write(folder, shape: Shape = Shape(), max_length: int = 128, provider_options: list | None = None,
          seed: int = 0) -> str:
    """model.onnx and genai_config.json in `folder`; returns the folder (what og.Config / og.Model take)."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    onnx.save(model(shape, seed), os.path.join(folder, "model.onnx"))
    with open(os.path.join(folder, "genai_config.json"), "w") as f:
        json.dump(config(shape, max_length, provider_options), f, indent=2)
    return folder


def prompt(n: int, vocab: int = Shape().vocab, seed: int = 1) -> list[int]:
    """n token ids, none of them genai's end of sequence (2), so that greedy decoding runs to max_length."""
    ids = np.random.default_rng(seed).integers(3, vocab, n)
    return [int(t) for t in ids]


def greedy(model_or_folder, tokens: list[int], new_tokens: int, provider: str | None = None,
           max_length: int | None = None) -> list[int]:
    """The tokens genai's greedy search appends to `tokens` (new_tokens of them, or fewer where it ends), with
    `model_or_folder` an og.Model or a folder (then `provider`, when given, is appended to its config)."""
    import onnxruntime_genai as og
    m = model_or_folder
    if not isinstance(m, og.Model):
        cfg = og.Config(os.fspath(m))
        if provider is not None:
            cfg.clear_providers()
            cfg.append_provider(provider)
        m = og.Model(cfg)
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=max_length or len(tokens) + new_tokens)
    generator = og.Generator(m, params)
    generator.append_tokens(tokens)
    made: list[int] = []
    while len(made) < new_tokens and not generator.is_done():
        generator.generate_next_token()
        made.append(int(generator.get_next_tokens()[0]))
    return made
