"""`pagellm bench grammar --corpus`: how much of JSON Schema each grammar backend enforces.

Every schema of bench/schema_corpus.py is compiled by each backend and, where it compiles,
sampled (`--samples` outputs at temperature 1 on the bundled model, prompted with the schema);
every finished output is validated with jsonschema (Draft 2020-12, with the formats its installed
checkers know). Systems:
- `xgrammar` and `guidance`: the library alone, every keyword let through (what the library does
  with a keyword it does not enforce shows as invalid outputs);
- `auto`: pagellm's default, which picks a backend per schema and refuses by name a keyword that
  neither enforces (engine/grammars/). Its invalid outputs must be 0.
Reported per system: schemas compiled and refused (with the reason), compile time, outputs
finished and invalid (with the schema names), so each table entry of UNENFORCED has its evidence.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from pagellm.bench import doc_sections
from pagellm.bench.schema_corpus import corpus

SYSTEMS = ("xgrammar", "guidance", "auto")
PROMPT = "Reply with one JSON value that matches this JSON schema.\nSchema: {schema}\nJSON:"


def run(args: argparse.Namespace) -> dict:
    import jsonschema

    from pagellm import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(args.model, max_num_seqs=64, seed=args.seed, max_model_len=2048)
    grammars = llm.engine.grammars
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    entries = corpus()
    load = {"loadavg_start": os.getloadavg()}
    systems = {}
    for system in SYSTEMS:
        grammars.screen_keywords = system == "auto"  # the libraries alone: every keyword let through
        compiled, refused, compile_ms = {}, {}, []
        for name, schema in entries:
            spec = StructuredOutputsParams(json=schema, backend=system)
            start = time.perf_counter()
            try:
                backend, _ = grammars.compile(spec)
            except ValueError as e:
                refused[name] = str(e)
                continue
            compile_ms.append((time.perf_counter() - start) * 1e3)
            compiled[name] = (spec, backend)
        params = [SamplingParams(n=args.samples, temperature=1.0, seed=args.seed, max_tokens=args.max_tokens,
                                 structured_outputs=spec) for spec, _ in compiled.values()]
        prompts = [PROMPT.format(schema=json.dumps(dict(entries)[name])) for name in compiled]
        outputs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
        finished = invalid = 0
        invalid_names: dict[str, str] = {}
        for (name, (spec, backend)), out in zip(compiled.items(), outputs):
            validator = jsonschema.Draft202012Validator(dict(entries)[name], format_checker=checker)
            for o in out.outputs:
                if o.finish_reason != "stop":
                    continue
                finished += 1
                try:
                    validator.validate(json.loads(o.text))
                except (ValueError, jsonschema.ValidationError) as e:
                    invalid += 1
                    invalid_names.setdefault(name, f"{backend}: {str(e).splitlines()[0][:160]}")
        print(f"{system}: {len(compiled)} compiled, {finished} of {len(compiled) * args.samples} outputs finished, "
              f"{invalid} invalid", flush=True)
        systems[system] = {
            "schemas": len(entries), "compiled": len(compiled), "refused": refused,
            "backends_chosen": dict(sorted({b: sum(1 for _, c in compiled.values() if c == b)
                                            for _, b in compiled.values()}.items())),
            "compile_ms_median": statistics.median(compile_ms) if compile_ms else None,
            "compile_ms_max": max(compile_ms) if compile_ms else None,
            "outputs": len(compiled) * args.samples, "finished": finished, "invalid": invalid,
            "invalid_schemas": invalid_names,
        }
    grammars.screen_keywords = True
    load["loadavg_end"] = os.getloadavg()
    return {"config": {k: v for k, v in vars(args).items() if k != "func"}, "load": load,
            "formats_checked": sorted(checker.checkers), "systems": systems}


def doc_table(result: dict) -> str:
    """docs/client-apis.md's table: per system, the corpus compiled, refused, finished and invalid."""
    rows = []
    for name, s in result["systems"].items():
        rows.append([name, s["schemas"], s["compiled"], len(s["refused"]),
                     f"{s['compile_ms_median']:.1f} / {s['compile_ms_max']:.0f} ms", s["outputs"], s["finished"],
                     s["invalid"]])
    return doc_sections.markdown_table(["system", "schemas", "compiled", "refused", "compile (median / max)",
                                      "outputs", "finished", "invalid"], rows, "lrrrrrrr")
