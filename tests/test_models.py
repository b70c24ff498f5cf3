"""Every encoder/decoder pair behind the Seq2Seq interface: parity between code paths, each
test in both kernel modes (the CPU kernels and the plain PyTorch reference, ``nmt.kernels``)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from nmt.data.tokenizer import BOS, PAD
from nmt.training.builders import instantiate_model
from tests.conftest import CONF_DIR

VOCAB = 40
# (model preset, extra overrides): the four presets, a hybrid each way and Transformer options.
VARIANTS = {
    "lstm": ("lstm", []),
    "lstm_bahdanau": ("lstm_bahdanau", []),
    "lstm_reversed": ("lstm", ["model.encoder.reverse=true", "model.encoder.bidirectional=false"]),
    "lstm_initial_state": ("lstm", ["model.decoder.input_feeding=none"]),  # Sutskever et al.: no fixed context at each step
    "lstm_bahdanau_reversed": ("lstm_bahdanau", ["model.encoder.reverse=true"]),
    "lstm_bahdanau_paper": ("lstm_bahdanau", ["model.decoder.output=maxout", "model.decoder.initial_state=tanh"]),
    "lstm_fixed_context_maxout": ("lstm", ["model.decoder.input_feeding=context", "model.decoder.output=maxout",
                                           "model.decoder.initial_state=tanh"]),  # Cho et al.'s fixed context, the deep output
    "lstm_luong": ("lstm_luong", []),
    "lstm_luong_dot_nofeed": ("lstm_luong", ["model.decoder.attention.score=dot", "model.decoder.input_feeding=none"]),
    "lstm_luong_concat": ("lstm_luong", ["model.decoder.attention.score=concat"]),
    "transformer": ("transformer", []),
    "transformer_post_learned": ("transformer", ["model.encoder.norm=post", "model.decoder.norm=post", "model.encoder.positions=learned", "model.decoder.positions=learned"]),
    "transformer_rope_local": ("transformer", ["model.encoder.positions=rope", "model.decoder.positions=rope", "model.encoder.attention=local",
                                               "model.encoder.window=2", "model.decoder.attention=local", "model.decoder.window=2"]),
    "transformer_local_global": ("transformer", ["model.encoder.attention=local_global", "model.encoder.window=1", "model.encoder.global_tokens=2",
                                                 "model.decoder.attention=local_global", "model.decoder.window=1", "model.decoder.global_tokens=2"]),
    "transformer_block_sparse": ("transformer", ["model.encoder.attention=block_sparse", "model.encoder.block_size=2",
                                                 "model.encoder.global_blocks=1", "model.encoder.random_blocks=1"]),
    "transformer_low_rank": ("transformer", ["model.encoder.attention=low_rank", "model.encoder.rank=4"]),
    "hybrid_transformer_luong": ("transformer", ["model/decoder=lstm_luong"]),
    "hybrid_transformer_plain_lstm": ("transformer", ["model/decoder=lstm"]),
    "hybrid_lstm_transformer": ("lstm_bahdanau", ["model/decoder=transformer"]),
}
KERNELS = ("cpu", "reference")
_built = {"kernels": "auto"}  # the mode ``build`` sets; the fixture below runs each test in both


@pytest.fixture(params=KERNELS, autouse=True)
def kernels(request):
    """Runs every test of a module that uses it (autouse) once per kernel mode."""
    _built["kernels"] = request.param
    yield request.param
    _built["kernels"] = "auto"


TINY_SIZES = ["model.emb_size=16", "model.hidden_size=16", "model.dropout=0.0", "model.tie_embeddings=false",
              "position_shift=0"]  # training passes start at position 0, as decoding does (the shift: its own test)


@functools.cache
def composed(name: str) -> DictConfig:
    """The model config of variant ``name`` (composing it costs more than building a tiny model)."""
    preset, overrides = VARIANTS[name]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=[f"model={preset}", *TINY_SIZES, *overrides]).model


def build(name: str, vocab: int = VOCAB) -> torch.nn.Module:
    model_cfg = copy.deepcopy(composed(name))
    with open_dict(model_cfg):
        model_cfg.src_vocab_size = vocab
        model_cfg.tgt_vocab_size = vocab
        model_cfg.share_src_tgt_embeddings = False
        for part in (model_cfg.encoder, model_cfg.decoder):
            if "num_heads" in part:
                part.num_heads, part.ff_size = 2, 32
    torch.manual_seed(0)
    return instantiate_model(model_cfg).set_kernels(_built["kernels"]).eval()


def batch(lengths=(7, 5, 3), tgt_len=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, VOCAB, (len(lengths), max(lengths)), generator=g)
    for i, n in enumerate(lengths):
        src[i, n:] = PAD
    tgt_in = torch.randint(4, VOCAB, (len(lengths), tgt_len), generator=g)
    tgt_in[:, 0] = BOS
    return src, src != PAD, tgt_in


def step_by_step(model, src, src_mask, tgt_in) -> torch.Tensor:
    """Teacher-forced logits (B, T, V) from one ``decode_step`` per target position."""
    memory = model.encode(src, src_mask)
    state = model.init_state(memory)
    steps = []
    for t in range(tgt_in.size(1)):
        logits, state, _ = model.decode_step(tgt_in[:, t], memory, state)
        steps.append(logits)
    return torch.stack(steps, 1)


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", VARIANTS)
def test_decode_step_equals_forward(name, mode):
    """Teacher-forced step-by-step decoding (with the key/value cache for Transformers) equals
    the full forward pass, also from a memory encoded in training mode (dropout is 0 here),
    where an LSTM decoder without a feed does not prepare its step weights."""
    model = build(name).train(mode == "train")
    src, src_mask, tgt_in = batch()
    full = model(src, src_mask, tgt_in)
    torch.testing.assert_close(step_by_step(model, src, src_mask, tgt_in), full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", VARIANTS)
def test_padding_does_not_change_a_sentence(name):
    """A sentence inside a padded batch gives the same logits as the sentence alone."""
    model = build(name)
    src, src_mask, tgt_in = batch(lengths=(9, 4))
    together = model(src, src_mask, tgt_in)
    alone = model(src[1:, :4], src_mask[1:, :4], tgt_in[1:])
    torch.testing.assert_close(together[1:], alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["lstm_reversed", "lstm_bahdanau_reversed"])
def test_reversed_encoder_reads_each_sentence_last_word_first(name):
    """``reverse``: the encoding of a sentence is the plain encoder's of its words in reverse
    order, with the outputs back in source order (so attention indexes source positions)."""
    model = build(name)
    plain = copy.deepcopy(model)
    plain.encoder.reverse = False
    src, src_mask, _ = batch(lengths=(7, 5, 3))
    flipped = src.clone()
    for i, n in enumerate(src_mask.sum(1).tolist()):
        flipped[i, :n] = src[i, :n].flip(0)
    ours, theirs = model.encoder(src, src_mask), plain.encoder(flipped, src_mask)
    for key in ("final_h", "final_c"):
        torch.testing.assert_close(ours[key], theirs[key])
    for i, n in enumerate(src_mask.sum(1).tolist()):
        torch.testing.assert_close(ours["enc_out"][i, :n], theirs["enc_out"][i, :n].flip(0))
    assert not torch.allclose(ours["final_h"], plain.encoder(src, src_mask)["final_h"])


@pytest.mark.parametrize("name", VARIANTS)
def test_gradients_do_not_share_storage(name):
    """Every parameter gets its own gradient memory, so in-place updates of gradients (clipping,
    accumulation over batches) touch each parameter once."""
    model = build(name).train()
    src, src_mask, tgt_in = batch()
    model(src, src_mask, tgt_in).logsumexp(-1).sum().backward()
    spans = sorted((p.grad.data_ptr(), p.grad.data_ptr() + p.grad.numel() * p.grad.element_size(), n)
                   for n, p in model.named_parameters() if p.grad is not None)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        assert end <= start, f"{a} and {b} share gradient memory"


PLAIN = ("lstm", "lstm_reversed", "lstm_initial_state", "lstm_fixed_context_maxout", "hybrid_transformer_plain_lstm")  # no attention


@pytest.mark.parametrize("name", [n for n in VARIANTS if n not in PLAIN])
def test_attention_is_a_distribution_over_real_tokens(name):
    model = build(name)
    src, src_mask, tgt_in = batch()
    attn = model.cross_attention(src, src_mask, tgt_in)  # (B, layers, heads, T, S)
    assert attn.dim() == 5 and attn.shape[-1] == src.size(1) and attn.shape[-2] == tgt_in.size(1)
    pad = ~src_mask[:, None, None, None, :].expand_as(attn)
    assert attn[pad].abs().max() == 0
    torch.testing.assert_close(attn.sum(-1), torch.ones(attn.shape[:-1]))


@pytest.mark.parametrize("name", PLAIN)
def test_plain_decoder_sees_the_source_only_through_its_initial_state(name):
    """The bottleneck baseline: no attention, and changing the encoder outputs while keeping the
    initial state fixed changes nothing."""
    model = build(name)
    assert model.cross_attention(*batch()) is None
    src, src_mask, tgt_in = batch()
    memory = model.encode(src, src_mask)
    state = model.init_state(memory)
    scrambled = {**memory, "enc_out": torch.randn_like(memory["enc_out"])}
    logits_a, _, attn = model.decode_step(tgt_in[:, 0], memory, state)
    logits_b, _, _ = model.decode_step(tgt_in[:, 0], scrambled, model.init_state(memory))
    assert attn is None
    torch.testing.assert_close(logits_a, logits_b)


@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rope"])
def test_transformer_encoder_is_order_sensitive(positions):
    """Swapping two source tokens changes the encoder output at the other positions too
    (it would not if positions were computed and dropped)."""
    model = build("transformer")
    if positions != "sinusoidal":
        name = "transformer_post_learned" if positions == "learned" else "transformer_rope_local"
        model = build(name)
    src, src_mask, _ = batch(lengths=(6,))
    swapped = src.clone()
    swapped[0, [1, 2]] = swapped[0, [2, 1]]
    out = model.encode(src, src_mask)["enc_out"]
    out_swapped = model.encode(swapped, src_mask)["enc_out"]
    assert (out[0, 0] - out_swapped[0, 0]).abs().max() > 1e-4


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_position_shift_starts_both_sides_at_the_sampled_position(positions):
    """With ``position_shift`` a training pass puts a sentence pair at positions k, k+1, ... on
    both sides (one random k per pair); evaluation always starts at 0."""
    name = "transformer" if positions == "sinusoidal" else "transformer_post_learned"
    model = build(name)
    model.encoder.position_shift = 7
    src, src_mask, tgt_in = batch()
    reference = model.features(src, src_mask, tgt_in)  # eval: no shift
    model.train()
    torch.manual_seed(3)
    shifted = model.features(src, src_mask, tgt_in)
    torch.manual_seed(3)
    shift = torch.randint(0, 8, (src.size(0),))
    assert shift.unique().numel() > 1, "pick a seed that gives the pairs different shifts"
    model.eval()
    # the same shifted pass by hand, one pair at a time, as a decoding step would place it
    for i, k in enumerate(shift.tolist()):
        enc = model.encoder
        x = enc.embed_tokens(src[i : i + 1], offset=k)
        for layer in enc.layers:
            x = layer(x, src_mask[i : i + 1, None, None, :])
        memory = model.decoder.prepare_memory({"enc_out": enc.final_norm(x), "src_mask": src_mask[i : i + 1]})
        dec = model.decoder
        y, _ = dec._layers(dec.embed_tokens(tgt_in[i : i + 1], offset=k), memory, None, False)
        torch.testing.assert_close(shifted[i], y[0])
    assert (shifted - reference).abs().max() > 1e-4
    assert type(model.encoder)(VOCAB, 16, 1, 2, 32, positions="rope", position_shift=3).position_shift == 0  # relative already


def test_tied_and_shared_embeddings():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["model=transformer", "model.hidden_size=16", "model.encoder.num_heads=2", "model.decoder.num_heads=2"])
    with open_dict(cfg):
        cfg.model.src_vocab_size = cfg.model.tgt_vocab_size = VOCAB
    model = instantiate_model(cfg.model)
    assert cfg.model.share_src_tgt_embeddings is True  # the synthetic data's vocabulary is joint
    assert model.decoder.out.weight is model.decoder.embed.weight
    assert model.encoder.embed.weight is model.decoder.embed.weight


def test_transformer_init_is_glorot_uniform_per_projection():
    """``init: xavier``: every attention and feed-forward weight (keys and values each on its own)
    is uniform within Glorot's bound, biases zero; ``init: torch`` keeps ``nn.Linear``'s."""
    from nmt.models.transformer import TransformerDecoder

    torch.manual_seed(0)
    xavier = TransformerDecoder(VOCAB, hidden_size=64, num_layers=1, num_heads=2, ff_size=256, init="xavier")
    torch.manual_seed(0)
    default = TransformerDecoder(VOCAB, hidden_size=64, num_layers=1, num_heads=2, ff_size=256, init="torch")
    for (name, w), (_, w_default) in zip(xavier.layers.named_parameters(), default.layers.named_parameters()):
        if "norms" in name:
            continue
        parts = w.chunk(2) if "kv_proj.weight" in name else (w,)
        for part in parts:
            if part.dim() == 2:
                bound = (6 / sum(part.shape)) ** 0.5
                assert part.abs().max() <= bound and part.abs().max() > 0.9 * bound, name
            else:
                assert not part.any(), name  # biases
        if w.dim() == 2:  # nn.Linear's own init: bound 1/sqrt(fan_in)
            assert w_default.abs().max() <= w_default.size(1) ** -0.5 and not torch.equal(w, w_default), name
    torch.manual_seed(0)
    small = TransformerDecoder(VOCAB, hidden_size=64, num_layers=1, num_heads=2, ff_size=256, init="xavier_small_output")
    for name, w in small.layers.named_parameters():
        if name.endswith("out_proj.weight"):  # the attentions' output maps only: within 0.02, near it at the edge
            assert 0.019 < w.abs().max() <= 0.02, name
        elif w.dim() == 2 and "norms" not in name:  # the others Glorot's, as with xavier
            assert w.abs().max() > 0.9 * (6 / sum(w.chunk(2)[0].shape if "kv_proj" in name else w.shape)) ** 0.5, name
    with pytest.raises(ValueError, match="init must be one of \\('xavier', 'xavier_small_output', 'torch'\\), got 'glorot'"):
        TransformerDecoder(VOCAB, hidden_size=64, num_layers=1, num_heads=2, ff_size=256, init="glorot")


def test_luong_dot_needs_equal_sizes():
    from nmt.models.attention import LuongAttention

    with pytest.raises(ValueError, match="score='dot' needs query_size == key_size, got 8 and 16"):
        LuongAttention(8, 16, score="dot")


@pytest.mark.parametrize("name", ["lstm", "lstm_initial_state", "lstm_reversed", "lstm_bahdanau", "lstm_bahdanau_paper",
                                  "lstm_luong", "hybrid_transformer_luong"])
def test_rnn_decoder_step_equals_nn_lstm(name):
    """The decoder steps on ``self.rnn``'s own weights (so checkpoints keep their parameter names):
    one ``decode_step`` gives the state ``nn.LSTM`` gives for [embedding; feed]."""
    model = build(name)
    decoder = model.decoder
    assert {"rnn.weight_ih_l0", "rnn.weight_hh_l1", "rnn.bias_ih_l1"} <= set(decoder.state_dict())
    src, src_mask, tgt_in = batch()
    memory = model.encode(src, src_mask)
    state = model.init_state(memory)
    for t in range(3):
        rnn_in = decoder.embed(tgt_in[:, t])
        if decoder.fixed_context:  # the encoder's top final state, the same at every step
            rnn_in = torch.cat([rnn_in, memory["final_h"][:, -1]], dim=-1)
        elif decoder.input_feeding == "context":
            rnn_in = torch.cat([rnn_in, decoder._attend(state["h"][:, -1], memory)[0]], dim=-1)
        elif decoder.input_feeding == "attentional":
            rnn_in = torch.cat([rnn_in, state["feed"]], dim=-1)
        hc = (state["h"].transpose(0, 1).contiguous(), state["c"].transpose(0, 1).contiguous())
        _, (h, c) = decoder.rnn(rnn_in.unsqueeze(1), hc)
        _, state, _ = model.decode_step(tgt_in[:, t], memory, state)
        torch.testing.assert_close(state["h"], h.transpose(0, 1), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(state["c"], c.transpose(0, 1), atol=1e-6, rtol=1e-5)


def test_bahdanau_paper_decoder_computes_appendix_a22():
    """``output: maxout`` and ``initial_state: tanh`` as Bahdanau et al. (2015), appendix A.2.2, write
    them, computed here by hand from the weights: s_0 = tanh(W_s h<-_1) (the backward encoder's
    state at the first word, which for a padded sentence is its own first position), c_i from
    s_(i-1), t~_i = U_o s_(i-1) + V_o E y_(i-1) + C_o c_i, t_i the max of adjacent pairs, logits W_o t_i."""
    model = build("lstm_bahdanau_paper")
    decoder, H = model.decoder, 16
    src, src_mask, tgt_in = batch()
    memory = model.encode(src, src_mask)
    backward_first = memory["enc_out"][:, 0, H // 2:]  # the backward direction's output at word 1
    torch.testing.assert_close(memory["final_h"][:, -1, H // 2:], backward_first)
    state = model.init_state(memory)
    s_prev = torch.tanh(backward_first @ decoder.init_proj.weight.T).view(-1, 2, H)
    torch.testing.assert_close(state["h"], s_prev)
    assert not state["c"].any()
    W = decoder.maxout.weight  # (2H, H + E + Hk): U_o | V_o | C_o
    U_o, V_o, C_o = W[:, :H], W[:, H:H + 16], W[:, H + 16:]
    for t in range(3):
        context, _ = decoder._attend(state["h"][:, -1], memory)
        t_tilde = state["h"][:, -1] @ U_o.T + decoder.embed(tgt_in[:, t]) @ V_o.T + context @ C_o.T
        t_i = torch.maximum(t_tilde[:, 0::2], t_tilde[:, 1::2])
        logits, state, _ = model.decode_step(tgt_in[:, t], memory, state)
        torch.testing.assert_close(logits, t_i @ decoder.out.weight.T, atol=1e-6, rtol=1e-5)


def test_the_paper_decoders_options_refuse_what_they_cannot_read():
    """Hydra names the config key it was building (``model.decoder``), then our message."""
    with pytest.raises(Exception, match=r"model.decoder.output=maxout is Bahdanau et al.'s deep output over s_\(i-1\), "
                                         r"y_\(i-1\) and the context c_i: it needs input_feeding: context, got 'attentional'"):
        composed_build("lstm_luong", ["model.decoder.output=maxout"])
    with pytest.raises(Exception, match=r"model.decoder.initial_state=tanh starts the decoder from tanh\(W_s h<-_1\), the backward "
                                         r"encoder's state at the first word \(Bahdanau et al. 2015\): it needs the "
                                         r"bidirectional LSTM encoder"):
        composed_build("transformer", ["model/decoder=lstm_bahdanau", "model.decoder.initial_state=tanh"])
    with pytest.raises(Exception, match=r"model.decoder.output must be one of \('tanh', 'maxout'\), got 'relu'"):
        composed_build("lstm_bahdanau", ["model.decoder.output=relu"])


def composed_build(preset: str, overrides: list[str]) -> torch.nn.Module:
    VARIANTS["_probe"] = (preset, overrides)
    composed.cache_clear()
    try:
        return build("_probe")
    finally:
        del VARIANTS["_probe"]
        composed.cache_clear()


@pytest.mark.parametrize("kind", ["bahdanau", "general", "dot", "concat", "transformer"])
@pytest.mark.parametrize("steps", [1, 3])
def test_queries_grouped_over_shared_memory_equal_a_copy_per_query(kind, steps):
    """Beam search keeps one copy of a sentence's memory for its beams: g query rows per memory
    row give what they give against the memory repeated g times."""
    from nmt.models.attention import BahdanauAttention, LuongAttention
    from nmt.models.transformer import MultiHeadAttention

    torch.manual_seed(0)
    n, g, S, H = 3, 4, 5, 8
    mask = torch.ones(n, S, dtype=torch.bool)
    mask[1, 3:] = False
    repeat = torch.arange(n).repeat_interleave(g)
    if kind == "transformer":
        attn = MultiHeadAttention(H, 2, 0.0).eval()
        q = attn.split(torch.randn(n * g, steps, H))
        k, v = attn.project_kv(torch.randn(n, S, H))
        m = mask[:, None, None, :]
        grouped = attn(q, k, v, m, need_weights=True)
        copied = attn(q, k[repeat], v[repeat], m[repeat], need_weights=True)
    else:
        attn = BahdanauAttention(H, H) if kind == "bahdanau" else LuongAttention(H, H, score=kind)
        query = torch.randn(n * g, H) if steps == 1 else torch.randn(n * g, steps, H)
        values = torch.randn(n, S, H)
        keys = attn.project_keys(values)
        grouped = attn(query, keys, values, mask)
        copied = attn(query, keys[repeat], values[repeat], mask[repeat])
    for a, b in zip(grouped, copied):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


def test_activation_and_logits_bias_default_to_the_plain_transformer():
    """``activation: relu`` and ``logits_bias: false`` (the configs' defaults) build the model as
    before the options existed (no output bias, ReLU); swish/gelu and a bias build what they name,
    the bias at zero, and the bias moves the logits."""
    from tests.test_export_ctranslate2 import build

    plain, _ = build([], 40)
    assert "decoder.out.bias" not in plain.state_dict()
    assert {type(layer.ff[1]) for stack in (plain.encoder, plain.decoder) for layer in stack.layers} == {torch.nn.ReLU}
    other, _ = build(["model.encoder.activation=gelu", "model.decoder.activation=swish",
                      "model.decoder.logits_bias=true"], 40)
    assert type(other.encoder.layers[0].ff[1]) is torch.nn.GELU and type(other.decoder.layers[0].ff[1]) is torch.nn.SiLU
    assert torch.equal(other.decoder.out.bias, torch.zeros(other.decoder.out.out_features))
    src, tgt_in = torch.tensor([[5, 6, 7, 3]]), torch.tensor([[BOS, 8, 9]])
    before = other(src, src != PAD, tgt_in)
    with torch.no_grad():
        other.decoder.out.bias[9] = 2.5
    assert torch.allclose(other(src, src != PAD, tgt_in)[..., 9], before[..., 9] + 2.5, atol=1e-5)
    with pytest.raises(Exception, match=r"activation must be one of \('relu', 'gelu', 'swish'\), got 'tanh'"):
        build(["model.encoder.activation=tanh"], 40)  # hydra's InstantiationException names the ValueError


@pytest.mark.parametrize("name", ["lstm_luong", "lstm_bahdanau", "hybrid_transformer_luong"])
def test_the_lstm_cell_state_is_fp32_at_every_step_under_bf16_autocast(name):
    """Greedy decoding under CPU bf16 autocast, from an encoder cell state in bf16 (what cuDNN's
    LSTM returns under autocast): the carried cell state is fp32 after every step, the logits equal
    those of a decoding that casts it to fp32 explicitly after each step, and they are closer to
    fp32 decoding than those of a decoding that carries the cell in bf16, as the decoders did. The
    decoder's forget gates are opened (bias 4) so that the cell sums many steps, as on long
    sentences, where a bf16 cell (8 bits of mantissa) drops the small updates."""
    model = build(name)
    with torch.no_grad():
        for layer in range(model.decoder.rnn.num_layers):
            getattr(model.decoder.rnn, f"bias_hh_l{layer}")[16:32] += 4.0  # the forget gates (i, f, g, o), H = 16
    src, src_mask, _ = batch()
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        state, prev, tokens = model.init_state(memory), torch.full((src.size(0),), BOS), []
        for _ in range(30):  # fp32 greedy: the tokens every decoding below is fed
            logits, state, _ = model.decode_step(prev, memory, state)
            prev = logits.argmax(-1)
            tokens.append(prev)

    def decode(autocast: bool, carry: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Log-probabilities (B, T, V), the cell states (B, T, L, H) and their dtypes per step."""
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            memory = model.encode(src, src_mask)
            if autocast:
                memory = {**memory, "final_c": memory["final_c"].bfloat16()}
            state, prev, out, cells = model.init_state(memory), torch.full((src.size(0),), BOS), [], []
            for token in tokens:
                logits, state, _ = model.decode_step(prev, memory, state)
                cells.append(state["c"])
                if carry is not None:
                    state = {**state, "c": state["c"].to(carry)}
                out.append(torch.log_softmax(logits.float(), -1))
                prev = token
        return torch.stack(out, 1), torch.stack([c.float() for c in cells], 1), [c.dtype for c in cells]

    fp32, fp32_cells, _ = decode(False)
    kept, kept_cells, dtypes = decode(True)
    assert dtypes == [torch.float32] * len(tokens)
    torch.testing.assert_close(kept, decode(True, carry=torch.float32)[0], rtol=0, atol=0)
    _, rounded_cells, _ = decode(True, carry=torch.bfloat16)
    assert (kept_cells - fp32_cells).abs().mean() < (rounded_cells - fp32_cells).abs().mean()
