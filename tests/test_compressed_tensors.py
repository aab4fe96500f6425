"""compressed-tensors checkpoints (llm-compressor's FP8 and W4A16 output), written here in their on-disk format by a
writer that follows compressed-tensors' own packing (pack_to_int32: q + 8 in nibble j of word w for column
8w + j; zero points packed along the rows), load to the weights that format's dequantization gives, exactly."""

import json

import pytest
import torch
from conftest import fresh
from safetensors.torch import save_file

import fastqwen
from fastqwen.quant import QuantLinear, quantize
from fastqwen.quant.checkpoints import from_pretrained
from fastqwen.quant.experts import QuantExperts

FP8 = torch.float8_e4m3fn


def ct_pack(values: torch.Tensor, dim: int) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 of signed 4-bit values (−8…7) along `dim` (1: weights, 0: zero points),
    padded to a multiple of 8 with zeros."""
    v = (values.to(torch.int32) + 8) if dim == 1 else (values.to(torch.int32) + 8).t()
    pad = -v.shape[1] % 8
    v = torch.cat([v, torch.zeros(v.shape[0], pad, dtype=torch.int32)], 1) if pad else v
    words = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for j in range(8):
        words |= v[:, j::8].to(torch.int64) << (4 * j)
    packed = (words - ((words >= 2**31).to(torch.int64) << 32)).to(torch.int32)  # (the word read as signed)
    return packed if dim == 1 else packed.t().contiguous()


def test_the_writer_packs_as_compressed_tensors_does():
    """pack_to_int32's known answer: signed values 1…7, 0 along a row (or, for zero points, down a column) are the
    nibbles 9…15, 8, first value lowest: the word 0x8FEDCBA9, read as a signed int32."""
    row = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]], dtype=torch.int8)
    assert ct_pack(row, 1).tolist() == [[0x8FEDCBA9 - 2**32]] and ct_pack(row.t(), 0).tolist() == [[0x8FEDCBA9 - 2**32]]
    assert ct_pack(row[:, :5], 1).tolist() == [[0xDCBA9]]  # (padded with −8: nibble 0)


def fp8_layer(w: torch.Tensor, strategy: str):
    """compressed-tensors' FP8 weight of w [N, K] per `strategy` (scale = absmax / 448 in bf16, the model dtype):
    ({weight, weight_scale}, the weight its dequantization gives)."""
    N, K = w.shape
    if strategy == "channel":
        scale = (w.abs().amax(1, keepdim=True) / 448).bfloat16()
        full = scale.float().expand(N, K)
    elif strategy == "tensor":
        scale = (w.abs().amax() / 448).bfloat16().reshape(1)
        full = scale.float().expand(N, K)
    else:
        blocks = torch.nn.functional.pad(w, (0, -K % 128, 0, -N % 128)).reshape(-(-N // 128), 128, -(-K // 128), 128)
        scale = (blocks.abs().amax((1, 3)) / 448).clamp(min=1e-8).bfloat16()
        full = scale.float().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    q = (w / full).clamp(-448, 448).to(FP8)
    return {"weight": q, "weight_scale": scale}, q.float() * full


def int4_layer(w: torch.Tensor, group: int, symmetric: bool, act_order: bool, packed_zero: bool = True, seed=0):
    """compressed-tensors' W4A16 weight of w [N, K] (group columns a group; act-order: a random column order's
    groups, with weight_g_idx): ({weight_packed, weight_scale, weight_shape, [weight_zero_point, weight_g_idx]},
    the weight its dequantization gives, (q − zp) · scale)."""
    N, K = w.shape
    g_idx = torch.arange(K) // group
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(seed))]
    groups = K // group
    cols = [w[:, g_idx == g] for g in range(groups)]
    if symmetric:
        scale = torch.stack([c.abs().amax(1) / 7.5 for c in cols], 1).bfloat16()
        zp = torch.zeros(N, groups, dtype=torch.int8)
    else:
        lo = torch.stack([c.amin(1).clamp(max=0) for c in cols], 1)
        hi = torch.stack([c.amax(1).clamp(min=0) for c in cols], 1)
        scale = ((hi - lo) / 15).bfloat16()
        zp = (-8 - lo / scale.float()).round().clamp(-8, 7).to(torch.int8)
    s, z = scale.float()[:, g_idx], zp.float()[:, g_idx]
    q = (w / s + z).round().clamp(-8, 7).to(torch.int8)
    t = {"weight_packed": ct_pack(q, 1), "weight_scale": scale, "weight_shape": torch.tensor([N, K])}
    if not symmetric:
        t["weight_zero_point"] = ct_pack(zp, 0) if packed_zero else zp
    if act_order:
        t["weight_g_idx"] = g_idx.to(torch.int32)
    return t, (q.float() - z) * s


def ct_config(weights: dict, fmt: str, **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head"], "sparsity_config": {}, "kv_cache_scheme": None, **extra}


def write_ct(path, model, layer, qc):
    """The checkpoint of `model` with each decoder linear of 16+ outputs and each routed expert (one module each)
    quantized by `layer(weight, seed)` → (tensors, reference); returns (path, {module: reference weight})."""
    tensors, reference = {}, {}
    names = {f"model.layers.{n}" for n, m in model.model.layers.named_modules()
             if isinstance(m, torch.nn.Linear) and m.out_features >= 16}
    for k, v in model.state_dict().items():
        module = k.removesuffix(".weight")
        if ".mlp.experts." in k:
            continue
        if module in names and k.endswith(".weight"):
            t, reference[module] = layer(v.detach().float(), len(reference))
            tensors.update({f"{module}.{n}": x for n, x in t.items()})
        else:
            tensors[k] = v
    for i, decoder in enumerate(model.model.layers):
        experts = getattr(decoder.mlp, "experts", None)
        if experts is None:
            continue
        I = experts.gate_up_proj.shape[1] // 2
        for e in range(experts.gate_up_proj.shape[0]):
            for proj, w in (("gate_proj", experts.gate_up_proj[e, :I]), ("up_proj", experts.gate_up_proj[e, I:]),
                            ("down_proj", experts.down_proj[e])):
                module = f"model.layers.{i}.mlp.experts.{e}.{proj}"
                t, reference[module] = layer(w.detach().float(), len(reference))
                tensors.update({f"{module}.{n}": x for n, x in t.items()})
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    return path, reference


def loaded_weight(model, module: str) -> torch.Tensor:
    """The fp32 weight the loaded model multiplies by for checkpoint module `module` (an expert's projection too)."""
    parent, _, name = module.rpartition(".")
    if ".mlp.experts." in module:
        experts_name, e = parent.rsplit(".", 1)
        experts = model.get_submodule(experts_name)
        assert isinstance(experts, QuantExperts)
        w = experts.weight("down" if name == "down_proj" else "gate_up", int(e)).float()
        I = experts.inter
        return w if name == "down_proj" else (w[:I] if name == "gate_proj" else w[I:])
    layer = model.get_submodule(module)
    assert isinstance(layer, QuantLinear)
    return layer.dequantized()


def check_loads_exactly(path, reference, scheme):
    model = from_pretrained(path, dtype=torch.float32)
    for module, ref in reference.items():
        assert torch.equal(loaded_weight(model, module), ref), module
    schemes = {m.scheme for m in model.modules() if isinstance(m, (QuantLinear, QuantExperts))}
    assert schemes == {scheme}
    ids = torch.randint(1, 500, (1, 12))
    expected = type(model).generate(model, ids, max_new_tokens=8, do_sample=False)
    fastqwen.optimize(model, compile=False, max_seq_len=64)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), expected)
    return model


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("strategy, scheme", [("channel", "fp8-weight"), ("tensor", "fp8-weight"), ("block", "fp8")])
def test_fp8_checkpoints_load_to_their_dequantized_weights(tmp_path, name, strategy, scheme):
    """float-quantized FP8 (FP8_DYNAMIC's per-row scales, per-tensor, 128×128 blocks; bf16 scales): every layer,
    experts too, multiplies by fp8 × scale exactly, in fp8-weight (rows) or fp8 (blocks); generate equals
    transformers' over the loaded model."""
    model = fresh(name, **({"moe_intermediate_size": 128} if name == "tiny-moe" else {}))
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
               "block_structure": [128, 128] if strategy == "block" else None}
    path, reference = write_ct(tmp_path / "ckpt", model, lambda w, seed: fp8_layer(w, strategy),
                               ct_config(weights, "float-quantized"))
    check_loads_exactly(path, reference, scheme)


@pytest.mark.parametrize("symmetric, act_order, packed_zero", [(True, False, True), (False, False, True),
                                                               (False, True, True), (False, False, False)])
@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_int4_checkpoints_load_to_their_dequantized_weights(tmp_path, name, symmetric, act_order, packed_zero):
    """pack-quantized W4A16, group 32 (groups of 128 take the same code path with the kernels' group), symmetric or
    not, act-order (weight_g_idx) or not, zero points packed (compressed-tensors ≥ 0.9.4) or unpacked int8 (older):
    every layer multiplies by (q − zp) · scale exactly; generate equals transformers' over the loaded model."""
    if act_order and name == "tiny-moe":
        pytest.skip("act-order experts are refused (test_errors below)")
    model = fresh(name, **({"moe_intermediate_size": 128} if name == "tiny-moe" else {}))
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": 32,
               "dynamic": False, "actorder": "group" if act_order else None}
    path, reference = write_ct(tmp_path / "ckpt", model,
                               lambda w, seed: int4_layer(w, 32, symmetric, act_order, packed_zero, seed),
                               ct_config(weights, "pack-quantized"))
    loaded = check_loads_exactly(path, reference, "int4")
    perms = [m.perm for m in loaded.modules() if isinstance(m, QuantLinear) and getattr(m, "perm", None) is not None]
    assert bool(perms) == act_order


@pytest.mark.parametrize("packed_zero", [True, False])
def test_zero_points_stored_under_a_symmetric_config_are_the_weights(tmp_path, packed_zero):
    """A symmetric int4 config whose layers store weight_zero_point all the same (packed, or older writers'
    unpacked int8, which compressed-tensors' dequantize subtracts): the weights are (q − zp) · scale, not the
    q · scale that the config alone gives."""
    model = fresh("tiny")
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    path, reference = write_ct(tmp_path / "ckpt", model, lambda w, seed: int4_layer(w, 32, False, False, packed_zero),
                               ct_config(weights, "pack-quantized"))
    loaded = from_pretrained(path, dtype=torch.float32)
    for module, ref in reference.items():
        assert torch.equal(loaded_weight(loaded, module), ref), module


def test_a_per_channel_int4_checkpoint_of_a_real_width_takes_the_kernel_group(tmp_path):
    """strategy "channel" (one scale a row) on in_features 256: stored as 128-column groups, the kernels' layout."""
    model = fresh("tiny", hidden_size=256, intermediate_size=256)
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "channel", "group_size": None}
    path, reference = write_ct(tmp_path / "ckpt", model, lambda w, seed: int4_layer(w, w.shape[1], False, False),
                               ct_config(weights, "pack-quantized"))
    loaded = check_loads_exactly(path, reference, "int4")
    assert loaded.model.layers[0].mlp.down_proj.stored_group() == 128


def loads_back_the_same(model, path):
    """from_pretrained(path) holds `model`'s state dict (same dtypes and values) and gives its greedy tokens."""
    loaded = from_pretrained(path, dtype=torch.float32)
    sa, sb = model.state_dict(), loaded.state_dict()
    assert sorted(sa) == sorted(sb)
    assert all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k].float(), sb[k].float()) for k in sa)
    ids = torch.randint(1, 500, (1, 12))
    assert torch.equal(type(loaded).generate(loaded, ids, max_new_tokens=8, do_sample=False),
                       type(model).generate(model, ids, max_new_tokens=8, do_sample=False))


def test_fp8_weight_saves_as_compressed_tensors_and_loads_back(tmp_path):
    """save_pretrained writes fp8-weight (no Qwen format holds per-row scales) as compressed-tensors' FP8 channel
    scheme, unquantized Linears in `ignore`; it loads back to the same stored tensors and tokens."""
    from fastqwen import presets

    model = quantize(fresh("tiny-moe", moe_intermediate_size=128), "fp8-weight")
    head = tmp_path / "mtp.safetensors"  # (a bf16 MTP head: named in `ignore`, or other readers take it for fp8)
    save_file({k: v.contiguous() for k, v in presets.random_mtp_tensors(model).items()}, str(head))
    path = fastqwen.save_pretrained(model, tmp_path / "q", mtp_from=head)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert "mtp.fc" in qc["ignore"] and "mtp.layers.0.self_attn.q_proj" in qc["ignore"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel" and "lm_head" in qc["ignore"]
    assert "model.layers.0.mlp.gate" in qc["ignore"]  # (the router: unquantized, a Linear to vLLM)
    loads_back_the_same(model, path)


def test_errors(tmp_path):
    """What is not loaded is refused by name: int8 weights (W8A8), 2:4 sparsity, two weight schemes, a missing
    zero point, a weight_shape of another layer, act-order experts; static input scales warn."""
    model = fresh("tiny")
    int4 = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
    layer = lambda w, seed: int4_layer(w, 32, False, False)  # noqa: E731
    cases = [({"num_bits": 8, "type": "int", "strategy": "channel"}, "int-quantized", {},
              r"weights int 8-bit, strategy 'channel', format 'int-quantized': supported are fp8"),
             (int4, "pack-quantized", {"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
             (int4, "pack-quantized", {"config_groups": {"a": {"weights": int4}, "b": {"weights": fp8}}},
              "2 different weight schemes"),
             (int4, "pack-quantized", {"quantization_status": "frozen"},
              "status 'frozen': only compressed checkpoints")]
    for i, (weights, fmt, extra, message) in enumerate(cases):
        path, _ = write_ct(tmp_path / f"c{i}", model, layer, ct_config(weights, fmt, **extra))
        with pytest.raises(ValueError, match=message):
            from_pretrained(path)

    def no_zero(w, seed):
        t, ref = int4_layer(w, 32, False, False)
        return {k: v for k, v in t.items() if k != "weight_zero_point"}, ref

    path, _ = write_ct(tmp_path / "nz", model, no_zero, ct_config(int4, "pack-quantized"))
    with pytest.raises(ValueError, match=r"model.layers.0.*holds no weight_zero_point"):
        from_pretrained(path)

    def transposed_shape(w, seed):
        t, ref = int4_layer(w, 32, False, False)
        return {**t, "weight_shape": t["weight_shape"].flip(0)}, ref

    path, _ = write_ct(tmp_path / "ts", model, transposed_shape, ct_config(int4, "pack-quantized"))
    with pytest.raises(ValueError, match=r"model.layers.0.*weight_shape \[\d+, \d+\] is not the layer's"):
        from_pretrained(path)

    moe = fresh("tiny-moe", moe_intermediate_size=128)
    path, _ = write_ct(tmp_path / "ao", moe, lambda w, seed: int4_layer(w, 32, False, True, seed=seed),
                       ct_config({**int4, "actorder": "group"}, "pack-quantized"))
    with pytest.raises(ValueError, match="act-order"):
        from_pretrained(path)

    static = ct_config(fp8, "float-quantized")
    static["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                               "dynamic": False}
    path, _ = write_ct(tmp_path / "st", model, lambda w, seed: fp8_layer(w, "channel"), static)
    with pytest.warns(UserWarning, match="static input activations: its input_scale tensors are ignored"):
        from_pretrained(path)


def test_a_quantized_router_is_refused_by_name(tmp_path):
    """model_free_ptq quantizes every 2-D weight that its ignore list does not name: a MoE router stored quantized
    (in transformers no Linear, so no QuantLinear's place) is refused by name, not an AttributeError."""
    from safetensors.torch import load_file

    model = fresh("tiny-moe", moe_intermediate_size=128)
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
    path, _ = write_ct(tmp_path / "ckpt", model, lambda w, seed: fp8_layer(w, "channel"),
                       ct_config(fp8, "float-quantized"))
    tensors = load_file(str(path / "model.safetensors"))
    router = tensors.pop("model.layers.0.mlp.gate.weight")
    tensors.update({f"model.layers.0.mlp.gate.{k}": v for k, v in fp8_layer(router.float(), "channel")[0].items()})
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate is stored quantized, but it is a \w+Router, no "
                                         r"Linear: only Linear layers load quantized"):
        from_pretrained(path)


@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_an_mtp_head_in_compressed_tensors_fp8_drafts_with_its_dequantized_weights(tmp_path, strategy):
    """llm-compressor's model-free FP8 quantizes the `mtp.*` linears too (weight × weight_scale): speculate="mtp"
    reads them back to fp8 × scale, and speculative greedy equals plain greedy."""
    from fastqwen import presets

    model = fresh("tiny")
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
               "block_structure": [128, 128] if strategy == "block" else None}
    path, _ = write_ct(tmp_path / "ckpt", model, lambda w, seed: fp8_layer(w, strategy),
                       ct_config(weights, "float-quantized"))
    mtp, reference = {}, {}
    for key, w in presets.random_mtp_tensors(model).items():
        if w.dim() == 2 and w.shape[0] >= 16:
            t, reference[key] = fp8_layer(w.float(), strategy)
            mtp.update({key: t["weight"], f"{key.removesuffix('.weight')}.weight_scale": t["weight_scale"]})
        else:
            mtp[key] = w
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(path / "model-mtp.safetensors"))
    loaded = from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(1, 500, (1, 12))
    expected = type(loaded).generate(loaded, ids, max_new_tokens=10, do_sample=False)
    fastqwen.optimize(loaded, compile=False, max_seq_len=64, speculate="mtp")
    assert torch.equal(loaded._fastqwen.spec.proposer.head.fc.weight, reference["mtp.fc.weight"])
    assert torch.equal(loaded.generate(ids, max_new_tokens=10, do_sample=False), expected)


def test_an_int4_mtp_head_is_refused_with_the_fix(tmp_path):
    from fastqwen.spec.mtp import read_mtp_tensors

    t, _ = int4_layer(torch.randn(64, 128) * 0.02, 32, True, False)
    save_file({f"mtp.fc.{k}": v for k, v in t.items()}, str(tmp_path / "mtp.safetensors"))
    with pytest.raises(ValueError, match="MTP head is stored in int4.*draft_quant='int4'"):
        read_mtp_tensors(tmp_path / "mtp.safetensors")


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_int4_saves_as_compressed_tensors_and_loads_back(tmp_path, name):
    """save_pretrained(int4_format="compressed-tensors"): asymmetric W4A16 (what vLLM serves; it refuses GPTQ's
    asymmetric form), routed experts one module each; it loads back to the same stored tensors and tokens, and its
    packing is compressed-tensors' (the tests' writer gives the same words for the dequantized codes)."""
    model = quantize(fresh(name, **({"moe_intermediate_size": 128} if name == "tiny-moe" else {})), "int4",
                     group_size=32)
    path = fastqwen.save_pretrained(model, tmp_path / "q", int4_format="compressed-tensors")
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (qc["format"], weights["strategy"], weights["group_size"], weights["symmetric"]) == (
        "pack-quantized", "group", 32, False)
    loads_back_the_same(model, path)
    from safetensors import safe_open

    layer = model.model.layers[0].mlp.down_proj if name == "tiny" else model.model.layers[0].mlp.shared_expert.down_proj
    key = "model.layers.0.mlp." + ("down_proj" if name == "tiny" else "shared_expert.down_proj")
    from fastqwen.quant.formats import unpack_int4, untile_int4

    codes = unpack_int4(untile_int4(layer.qweight)).to(torch.int8) - 8  # (q, signed, as compressed-tensors holds it)
    zp = layer.zero.to(torch.int8) - 8  # (group 32 < 128: stored one a group)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor(f"{key}.weight_packed"), ct_pack(codes, 1))
        assert torch.equal(f.get_tensor(f"{key}.weight_zero_point"), ct_pack(zp, 0))


def test_act_order_int4_saves_as_compressed_tensors_with_its_g_idx(tmp_path):
    """An act-order W4A16 checkpoint loads, saves as compressed-tensors and loads back to the same tensors, its
    weight_g_idx as it was; a zero of 16 (GPTQ's v1 can hold it) and an unknown int4_format are refused."""
    model = fresh("tiny")
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32,
               "actorder": "group"}
    path, _ = write_ct(tmp_path / "ckpt", model, lambda w, seed: int4_layer(w, 32, False, True, seed=seed),
                       ct_config(weights, "pack-quantized"))
    loaded = from_pretrained(path, dtype=torch.float32)
    loaded.model.layers[1].mlp.up_proj.perm = None  # (a layer in column order: it gets an identity g_idx)
    saved = fastqwen.save_pretrained(loaded, tmp_path / "saved", int4_format="compressed-tensors")
    assert json.loads((saved / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "weights"]["actorder"] == "group"
    again = from_pretrained(saved, dtype=torch.float32)
    sa, sb = loaded.state_dict(), again.state_dict()
    assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k].float(), sb[k].float()) for k in sa)
    from safetensors import safe_open

    key = "model.layers.0.mlp.down_proj.weight_g_idx"
    with safe_open(str(path / "model.safetensors"), "pt") as a, safe_open(str(saved / "model.safetensors"), "pt") as b:
        assert torch.equal(a.get_tensor(key), b.get_tensor(key))
        packed = [k[:-len("weight_packed")] for k in b.keys() if k.endswith(".weight_packed")]
        assert packed and all(k + "weight_g_idx" in b.keys() for k in packed)  # (every layer, under act-order)
        up = b.get_tensor("model.layers.1.mlp.up_proj.weight_g_idx")
        assert torch.equal(up, torch.arange(up.numel(), dtype=torch.int32) // 32)
    with torch.no_grad():
        loaded.model.layers[0].mlp.down_proj.zero[0, 0] = 16
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: .*zeros 0…15; got zeros \d+…16 \(a GPTQ"):
        fastqwen.save_pretrained(loaded, tmp_path / "z16", int4_format="compressed-tensors")
    with pytest.raises(ValueError, match="int4_format='awq': 'gptq' \\(the default\\) or 'compressed-tensors'"):
        fastqwen.save_pretrained(loaded, tmp_path / "x", int4_format="awq")
