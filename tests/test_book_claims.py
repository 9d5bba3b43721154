"""The book's sentences that a reader could check against the code or the literature, checked here.

Each test reads a chapter's source (found by its label, so the file's name does not matter) and
holds a sentence to the code or numbers it describes: an old wrong sentence fails, the corrected
one passes.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

BOOK = Path(__file__).resolve().parents[1] / "book"


def page(label: str) -> str:
    """The MyST source of the page whose first line is ``(label)=``."""
    for path in sorted(BOOK.glob("*.md")):
        text = path.read_text()
        if text.split("---\n", 2)[-1].lstrip().startswith(f"({label})="):
            return text
    raise LookupError(f"no page starts with the label {label}")


def prose(label: str) -> str:
    """The page's text outside code cells, with line breaks folded to spaces."""
    text = re.sub(r"```\{code-cell\}.*?```", "", page(label), flags=re.S)
    return re.sub(r"\s+", " ", text)


def test_mla_decoding_applies_w_uv_then_w_o_as_the_page_says():
    from mha_lab.cpu.latent import LatentAttention

    code = inspect.getsource(LatentAttention._attend_latent)
    assert "@ W_UV" in code and "@ self.W_O" in code and "einsum" not in code
    text = prose("ch-gqa")
    assert "forms the product only to show" not in text and "above used both" not in text
    assert "applies $W_{UV}$ and then $W_O$" in text
    assert "That is the order `LatentAttention._attend_latent` uses." in text


def test_decode_intensity_sentences_follow_the_computed_figures():
    """No fixed "memory-bound" claim: the section's heading asks, and the verdicts are computed by
    ``roofline`` from ``decode_attention_intensity`` against each ridge."""
    text = prose("ch-gqa")
    assert "## Why decoding is memory-bound" not in page("ch-gqa")
    assert "## FLOPs per byte: when decoding is memory-bound" in page("ch-gqa")
    assert "far below a GPU's ridge point of hundreds" not in text
    assert "The only levers are fewer bytes per cached token" not in text
    for key in ("int-ds-verdict", "int-here-verdict", "int-here-then", "int-mla-verdict", "int-summary"):
        assert f"{{glue:text}}`{key}`" in text
    src = page("ch-gqa")
    assert 'roofline(int_ds, ridge_h100)' in src and 'roofline(int_here, ridge_here, margin_ridge)' in src
    assert 'decode_attention_intensity(DEEPSEEK_V2, "bfloat16", v)' in src


def test_read_matrix_is_compared_with_the_cache_by_a_computed_ratio():
    text = prose("ch-gqa")
    assert "twice the processor's last-level cache, kept between" not in text
    assert "{glue:text}`t-read-vs-llc`" in text and "read_matrix_bytes() / llc" in page("ch-gqa")


def test_enable_gqa_names_the_kernels_that_refuse_it():
    text = prose("ch-gqa")
    assert "pytorch/pytorch/issues/139586" in text
    assert "memory-efficient kernel refuses fewer key/value heads" in text
    assert "(any `attn_mask`, float32, a GPU older than Ampere)" in text


def test_the_fused_backward_is_credited_to_flashattention_1_as_well():
    text = prose("ch-memory")
    assert "the second half of FlashAttention-2" not in text
    assert "FlashAttention-2 fuses the backward into a kernel as well" not in text
    assert "FlashAttention already had one (its Algorithm 4)" in text
    assert "parallelises it over key blocks" in text


def test_flashattention_2_is_not_said_to_use_the_same_tiles():
    text = prose("ch-memory")
    assert "as FlashAttention with the same tiles" not in text
    assert "with block sizes of its own" in text


def test_the_self_match_sentence_admits_the_ties_the_scores_show():
    """The printed scores tie "the" with "on" and "mat" with "cat" (1.125 each): not "matches itself best"."""
    import numpy as np

    text = prose("ch-intuition")
    assert "a word matches itself best" not in text
    assert "{glue:text}`self-ties`" in text and "could even beat the match with itself" in text
    vectors = {"the": [0, 0, 0, 1], "cat": [1, 1, 0, 0], "on": [0, 0, 0.5, 1], "mat": [1, 0, 0, 0]}
    X = 1.5 * np.array(list(vectors.values()))
    s = X @ X.T / 2
    assert s[0, 0] == s[0, 2] == s[3, 3] == s[3, 1] == 1.125  # the ties the glue names


def test_masking_introduction_names_cross_attention_and_places_causal_alignment_as_self_attention():
    src, text = page("ch-masking"), prose("ch-masking")
    assert "Two masks cover almost every use" not in text
    assert "cross-attention, with queries from one sequence" in text
    assert "how a causal mask is aligned when" in text
    assert "### Causal masks when" not in src  # no longer a subsection of cross-attention
    assert "## Causal self-attention with $L_q \\neq L_k$" in src
    assert "The cases in this section are self-attention, not cross-attention" in text


def test_the_traffic_section_uses_the_papers_blocks_and_states_the_standard_re_reads():
    src, text = page("ch-memory"), prose("ch-memory")
    assert "what it pays instead is re-reading $K$ and $V$ once for every query tile" not in text
    assert "for every key/value block, $Q$, $O$, $s_\\text{max}$ and $\\ell$ are read" in text
    assert "$B_c = \\lceil M_\\text{SRAM} / 4 d_k \\rceil$" in text
    assert "so that only $S$ and $P$ differ" not in text
    assert "its count is $2 L d_k (1 + T) + 4L^2$" in text
    assert "and bend once the $b^2$ score tile takes a noticeable part of fast memory" not in text
    assert "standard algorithm moves $\\Theta(L d_k + L^2)$ elements" not in text
    assert 'tiling="square"' in text and "a variant kept for comparison" in text
    assert "tr-big-fa1-elems" in src and "12 * N_big**2 * d_big**2 / M_big" in src


def test_one_symbol_one_meaning_for_the_running_maximum_and_fast_memory():
    """m is a query's position (positions chapter, RoPE); the running maximum is s_max. M is the mask;
    fast memory is M_SRAM."""
    for label in ("ch-memory", "ch-math"):
        text = prose(label)
        assert "running maximum $m$" not in text and "maximum $m$" not in text and "$m'" not in text
        assert "s_\\text{max}" in text
    assert "derived from $M$)" not in prose("ch-memory")
    notation = page("notation")
    assert "| $m$, $\\ell$, $\\text{acc}$ |" not in notation
    assert "| $s_\\text{max}$, $\\ell$, $\\text{acc}$ |" in notation
    assert "| $p$; $m$, $n$ |" in notation and "| $M$ | `mask` |" in notation


def test_the_parts_rates_are_not_used_to_explain_a_forward_they_do_not_add_up_to():
    src, text = page("ch-flops"), prose("ch-flops")
    assert "{glue:text}`parts-vs-forward` {glue:text}`parts-caveat`" in text
    assert "relation(parts_s[L], forward_s[L], parts_margin)" in src
    assert "the parts timed alone do not reproduce the forward" in src


def test_an_array_of_exactly_a_caches_size_is_not_said_to_simply_fit_it():
    from mha_lab.verdict import cache_fit

    words = cache_fit(2**20, 2**26, {2: 2**20, 3: 32 * 2**20})
    assert "exactly the size of its level-2 cache, so it fits there only while nothing else does" in words


def test_timing_verdicts_rest_on_the_spread_measured_in_the_build():
    """No asserted "one timing can be off by 10%": each timing chapter repeats its fastest-of-N readings in
    interleaved rounds and passes ``paired_margin`` of the pairs to every timing verdict."""
    text = prose("ch-reshape")
    assert "one timing can be off by" not in text and "{glue:text}`timing-noise`" not in text
    assert "{glue:text}`loop-readings` ms and the fused layer {glue:text}`fused-readings` ms" in text
    assert "no measurable difference on this machine" in text
    gqa = page("ch-gqa")
    for call in ('speed("MHA", at["MHA"]["ms"], "GQA", at["GQA"]["ms"], margin_pair)',
                 'relation(at[n]["rate"], read_peak, margin_ceiling)',
                 "relation(time_ratio, bytes_ratio, margin_pair)"):
        assert call in gqa
    assert 'speed("the loop", last["loop_s"], "the fused layer", last["fused_s"], margin)' in page("ch-reshape")


def test_every_timing_chapter_takes_its_margin_from_the_pairs_and_says_when_it_is_too_noisy():
    """The readings are interleaved, so they come in pairs: the margin is the spread of the per-pair ratios, not
    the product of the two series' spreads (205% where the pairs agree within 5.5%), and a margin above half is
    "too noisy on this build to say", with no explanation drawn from it."""
    from mha_lab import verdict

    assert not hasattr(verdict, "timing_margin")
    for label in ("ch-reshape", "ch-flops", "ch-gqa", "ch-memory"):
        src = page(label)
        assert "timing_margin" not in src and "TIMING_MARGIN" not in src and "TIMING_NOISE" not in src, label
        assert "paired_margin(" in src, label
    reshape = prose("ch-reshape")
    assert "can be off by the product of the two, $(1 + s_1)(1 + s_2) - 1$" not in reshape
    assert "{glue:text}`pair-ratios`" in reshape and "{glue:text}`growth-words`" in reshape
    assert "margin = paired_margin(last[\"loop_runs\"], last[\"fused_runs\"])" in page("ch-reshape")
    flops_src, flops = page("ch-flops"), prose("ch-flops")
    assert "told apart only beyond" not in flops and "(`timing_margin`" not in flops
    assert "if too_noisy(parts_margin):" in flops_src
    assert "relation(parts_s[L], forward_s[L], parts_margin)" in flops_src
    assert "if too_noisy(margin):" in flops_src and "elif not any(signs.values()):" in flops_src
    assert '"parts_lengths"' not in flops_src  # the parts are timed in pairs with the forward, not by the bench
    memory_src = page("ch-memory")
    assert "interleaved_times(" not in memory_src
    assert 'min(readings["fused"]), time_margin)' in memory_src
    gqa = page("ch-gqa")
    assert "if too_noisy(margin_ceiling):" in gqa
    assert 'so this page draws nothing from it" if too_noisy(margin_pair)' in gqa
    assert "margin_pair = paired_margin(readings[\"MHA\"], readings[\"GQA\"])" in gqa


def test_a_spec_sheet_roofline_has_a_stated_threshold_and_the_prose_digits():
    """242/295 = 0.82 is judged by a band the page states (a factor of 2), not by a timing margin, and the
    intensities in the sentences are printed with the verdict's digits (242, not 240 beside 242)."""
    src, text = page("ch-gqa"), prose("ch-gqa")
    assert "within a factor of {glue:text}`roofline-band` of the ridge" in text and "`ROOFLINE_BAND`" in text
    for key in ("int-mla-abs", "int-mla-rebuilt", "int-mqa-ds"):
        assert re.search(rf'glue\("{key}", whole_or_two_digits\(', src), key
    assert "roofline(int_ds, ridge_h100)" in src and "roofline(int_mla, ridge_h100)" in src


def test_the_home_pages_map_names_each_chapter_by_its_number_and_title():
    """The map's node "8 GQA, MQA, MLA and the KV cache" is chapter 8's title in the sidebar too, and the n-th
    chapter of the table of contents is the map's n."""
    import yaml

    toc = yaml.safe_load((BOOK.parent / "_toc.yml").read_text())
    numbered = [entry["file"] for part in toc["parts"] if part.get("numbered") for entry in part["chapters"]]
    labels = dict(re.findall(r"\[(\d+) ([^\]]+)\]", page("home").split("```{mermaid}")[1].split("```")[0]))
    assert len(labels) == len(numbered)
    for n, file in enumerate(numbered, 1):
        title = re.search(r"^# (.+)$", (BOOK.parent / f"{file}.md").read_text(), re.M).group(1)
        assert title.lower().startswith(labels[str(n)].lower()) or labels[str(n)] in {
            "Intuition", "Math and worked example", "Reshape trick and memory layout", "Backward pass",
            "Graded assignments"}, (n, labels[str(n)], title)
    assert labels["8"] == "GQA, MQA, MLA and the KV cache" and labels["4"] == "Masking and cross-attention"


def test_the_home_page_names_every_chapter_that_runs_without_pytorch():
    """The decoding chapter needs only NumPy too: its code cells never name torch, and every mha_lab module the
    named chapters import loads with torch unavailable."""
    import subprocess
    import sys

    sentence = re.search(r"reference need only NumPy, and the (.*?) chapters run without PyTorch", prose("home"))
    named = re.findall(r"<(ch-[\w-]+)>", sentence.group(1))
    assert "ch-decoding" in named and len(named) == 4
    modules = set()
    for label in named:
        code = "\n".join(re.findall(r"```\{code-cell\}.*?```", page(label), flags=re.S))
        assert not re.search(r"\btorch\b", code), label
        modules |= set(re.findall(r"^\s*(?:from|import) (mha_lab[\w.]*)", code, flags=re.M))
    script = ("import importlib, sys\nsys.modules['torch'] = None\n"
              + "".join(f"importlib.import_module({m!r})\n" for m in sorted(modules)))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_yarn_names_the_papers_ramp_and_the_reference_codes_and_uses_the_codes():
    src, text = page("ch-decoding"), prose("ch-decoding")
    assert "a linear ramp blends the two between; it also" not in text
    assert "The paper's is linear in the number of turns $r_i$" in text
    assert "is linear in the pair index $i$ instead" in text and "(`yarn_ramp_bounds`" in text
    assert "{glue:text}`rope-ramp-turns`" in text and "{glue:text}`rope-ramp-index`" in text
    assert 'yarn_frequencies(D_HEAD, S, TRAIN, ramp="index")' in src
    assert 'yarn_frequencies(D_HEAD, S, TRAIN, ramp="turns")' in src


def test_kivi_is_counted_as_the_paper_runs_it_and_its_answer_matched_exactly():
    """A per-channel scale over the whole cache is no longer labelled KIVI; KIVI's rows count grouped keys, zero
    points and the float16 residual; the self-check's answer (24,576 bytes: codes 16,384, key groups 4,096, value
    groups 4,096) is matched exactly, so the answer without the key groups (4,096 short) fails."""
    from mha_lab.cpu.quantized import LAYOUTS, quantize_groups

    src, text = page("ch-decoding"), prose("ch-decoding")
    assert not any("KIVI" in name for name in LAYOUTS)
    assert "over a long cache those scales cost almost nothing" not in text
    assert "cannot be known while tokens still arrive" in text and "`kivi_quantize`" in text
    assert "kivi_attention_error(" in src and "{glue:text}`q-kivi-k-pairs`" in text
    check = re.search(r":::\{self-check\}[^\n]*KIVI.*?\n:::", src, flags=re.S).group(0)
    assert ":number: sc-dec-kivi-bytes" in check and re.search(r"^:tolerance: 0$", check, flags=re.M)
    assert "24,576 bytes in all" in check
    ones = __import__("numpy").ones((1, 8, 4096, 128))
    layer = quantize_groups(ones, 2, "channel", 32).nbytes + quantize_groups(ones, 2, "token", 32).nbytes
    assert 32 * layer / 4096 == 24_576


def test_prefix_sharing_is_hashed_full_blocks_beside_fork_and_copy_on_write():
    text = prose("ch-decoding")
    assert "or a long system prompt shared by many requests, would store" not in text
    assert "have no parent to fork from" in text
    assert "a hash of its parent block's hash and its own tokens" in text
    assert "prefix caching needs no copy-on-write" in text and "(**copy-on-write**)" in text


def test_the_decoding_chapter_says_what_the_papers_and_servers_do():
    """PI and YaRN are fine-tuned after the change; GPT-NeoX's partial rotary takes theta^(-2i/d_rot); the fp8
    row's scale is one per sequence and head here and one per layer in vLLM; the split-K self-check asks why,
    not for FlashAttention-2's constants."""
    text = prose("ch-decoding")
    assert "followed in their papers by a short fine-tune at the longer length" in text
    assert "$\\theta_\\text{base}^{-2i/d_\\text{rot}}$" in text and "`rope_frequencies(d_rot)`" in text
    assert "one `k_scale` and one `v_scale` for each attention layer" in text
    assert "fp8 e4m3, K per tensor" not in page("ch-decoding")
    assert "how many programs does one split-K decoding step launch" not in text
    assert "Why does splitting the keys into chunks speed up a step for a batch of 1 but not for a batch of 8?" in text


def test_the_decoding_chapter_uses_the_notation_pages_symbols():
    """omega_i = theta_base^(-2i/d_k), no bare d; the chunk maxima are s_max,c, not m_c and M (a query's position
    and the mask); kappa stretches, Delta scales (s is bytes per element in the GQA chapter); L_train, not L; YaRN's
    bounds are beta_fast and beta_slow, not alpha (ALiBi's slope)."""
    text, notation = prose("ch-decoding"), page("notation")
    for old in ("$f_i = \\theta^{-2i/d}$", "$m_c$", "$M = \\max_c m_c$", "$\\alpha$ = 1", "$s = \\max|x|",
                "context $s$ times longer", "trained on $L$"):
        assert old not in text, old
    for new in ("$\\omega_i = \\theta_\\text{base}^{-2i/d_k}$", "$s_\\text{max} = \\max_c s_{\\text{max},c}$",
                "$\\kappa$", "$L_\\text{train}$", "$\\beta_\\text{slow}$ = 1", "$\\Delta = \\max|x| / q_{\\max}$"):
        assert new in text, new
    for row in ("| $\\theta_\\text{base}$ | `base` |", "| $\\kappa$ | `factor` |", "| $L_\\text{train}$ |",
                "| $\\beta_\\text{fast}$, $\\beta_\\text{slow}$ |", "| $\\Delta$, $z$ | `scale`, `zero` |"):
        assert row in notation, row
