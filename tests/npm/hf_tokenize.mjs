// Reference token ids and decoded text from Hugging Face `tokenizers` (the Rust library's npm
// binding) for kiln's tokenizer tests.
//   node hf_tokenize.mjs < requests.jsonl > results.jsonl
// The first input line is {"tokenizers": {"name": "path/to/tokenizer.json", ...}}, every further
// line one JSON string. For each tokenizer one output line:
//   {"tokenizer": name, "results": [{"ids": [...], "ids_with_special": [...], "decoded": text,
//                                    "decoded_skip_special": text}, ...]}
// with ids encoded without and with added special tokens, and the decodings of the first.
import { readFileSync } from 'node:fs';
import { requireReference } from './reference_packages.mjs';

const { Tokenizer } = requireReference('tokenizers');

const lines = readFileSync(0, 'utf8').split('\n').filter((line) => line.length > 0);
const { tokenizers } = JSON.parse(lines[0]);
const texts = lines.slice(1).map((line) => JSON.parse(line));

for (const [name, file] of Object.entries(tokenizers)) {
  const tokenizer = Tokenizer.fromFile(file);
  const encodings = await tokenizer.encodeBatch(texts, { addSpecialTokens: false });
  const idLists = encodings.map((encoding) => Array.from(encoding.getIds()));
  const withSpecial = await tokenizer.encodeBatch(texts, { addSpecialTokens: true });
  const decoded = await tokenizer.decodeBatch(idLists, false);
  const decodedSkipSpecial = await tokenizer.decodeBatch(idLists, true);
  const results = idLists.map((ids, i) => ({
    ids,
    ids_with_special: Array.from(withSpecial[i].getIds()),
    decoded: decoded[i],
    decoded_skip_special: decodedSkipSpecial[i],
  }));
  process.stdout.write(JSON.stringify({ tokenizer: name, results }) + '\n');
}
