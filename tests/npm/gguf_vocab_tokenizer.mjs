// Writes the tokenizer.json that Hugging Face transformers' slow-to-fast converters
// (convert_slow_tokenizer.py: LlamaConverter with legacy=True, GPT2Converter) make for the
// vocabulary stored in one of llama.cpp's models/ggml-vocab-*.gguf files, so that llama.cpp's test
// vectors for models without a tokenizer.json in npm (Llama-2, GPT-2) can be checked.
//   node gguf_vocab_tokenizer.mjs vocab.gguf tokenizer.json
import { readFileSync, writeFileSync } from 'node:fs';

// --- GGUF metadata (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) ---
function readGgufMetadata(file) {
  const buffer = readFileSync(file);
  let offset = 0;
  const u32 = () => { const v = buffer.readUInt32LE(offset); offset += 4; return v; };
  const u64 = () => { const v = buffer.readBigUInt64LE(offset); offset += 8; return Number(v); };
  const string = () => { const n = u64(); const v = buffer.toString('utf8', offset, offset + n); offset += n; return v; };
  const scalarReaders = {
    0: () => buffer.readUInt8(offset++), 1: () => buffer.readInt8(offset++),
    2: () => { const v = buffer.readUInt16LE(offset); offset += 2; return v; },
    3: () => { const v = buffer.readInt16LE(offset); offset += 2; return v; },
    4: u32, 5: () => { const v = buffer.readInt32LE(offset); offset += 4; return v; },
    6: () => { const v = buffer.readFloatLE(offset); offset += 4; return v; },
    7: () => buffer.readUInt8(offset++) !== 0, 8: string, 10: u64,
    11: () => { const v = buffer.readBigInt64LE(offset); offset += 8; return Number(v); },
    12: () => { const v = buffer.readDoubleLE(offset); offset += 8; return v; },
  };
  const value = (type) => {
    if (type === 9) {
      const elementType = u32();
      const count = u64();
      return Array.from({ length: count }, () => value(elementType));
    }
    if (!(type in scalarReaders)) throw new Error(`${file}: unknown GGUF value type ${type}`);
    return scalarReaders[type]();
  };
  if (buffer.toString('ascii', 0, 4) !== 'GGUF') throw new Error(`${file}: not a GGUF file`);
  offset = 4;
  u32(); // version
  u64(); // tensor count
  const keyCount = u64();
  const metadata = {};
  for (let i = 0; i < keyCount; i++) {
    const key = string();
    metadata[key] = value(u32());
  }
  return metadata;
}

const [ggufPath, outputPath] = process.argv.slice(2);
const metadata = readGgufMetadata(ggufPath);
const tokens = metadata['tokenizer.ggml.tokens'];
const types = metadata['tokenizer.ggml.token_type'];
const kind = metadata['tokenizer.ggml.model'];
// llama.cpp token types: 2 unknown, 3 control.
const addedTokens = tokens
  .map((content, id) => ({ id, content, type: types[id] }))
  .filter((token) => token.type === 2 || token.type === 3)
  .map(({ id, content }) => ({ id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true }));
const vocab = Object.fromEntries(tokens.map((token, id) => [token, id]));

let tokenizer;
if (kind === 'llama') {
  // SentencePieceExtractor.extract: every split of every piece into two pieces, the splits of one
  // piece ordered by the ids of their halves, then all ordered by the score of the piece (stable).
  const scores = metadata['tokenizer.ggml.scores'];
  const merges = [];
  tokens.forEach((piece, id) => {
    const characters = Array.from(piece);
    const local = [];
    for (let i = 1; i < characters.length; i++) {
      const left = characters.slice(0, i).join('');
      const right = characters.slice(i).join('');
      if (left in vocab && right in vocab) local.push([left, right, scores[id]]);
    }
    local.sort((a, b) => vocab[a[0]] - vocab[b[0]] || vocab[a[1]] - vocab[b[1]]);
    merges.push(...local);
  });
  merges.sort((a, b) => b[2] - a[2]);
  const unknown = tokens[metadata['tokenizer.ggml.unknown_token_id']];
  const bos = tokens[metadata['tokenizer.ggml.bos_token_id']];
  tokenizer = {
    version: '1.0', truncation: null, padding: null,
    added_tokens: addedTokens,
    normalizer: { type: 'Sequence', normalizers: [
      { type: 'Prepend', prepend: '\u2581' },
      { type: 'Replace', pattern: { String: ' ' }, content: '\u2581' },
    ] },
    pre_tokenizer: null,
    post_processor: { type: 'TemplateProcessing',
      single: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
      pair: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
             { SpecialToken: { id: bos, type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
      special_tokens: { [bos]: { id: bos, ids: [vocab[bos]], tokens: [bos] } } },
    decoder: { type: 'Sequence', decoders: [
      { type: 'Replace', pattern: { String: '\u2581' }, content: ' ' },
      { type: 'ByteFallback' }, { type: 'Fuse' },
      { type: 'Strip', content: ' ', start: 1, stop: 0 },
    ] },
    model: { type: 'BPE', dropout: null, unk_token: unknown, continuing_subword_prefix: null,
             end_of_word_suffix: null, fuse_unk: true, byte_fallback: true, ignore_merges: false,
             vocab, merges: merges.map(([left, right]) => [left, right]) },
  };
} else if (kind === 'gpt2') {
  const byteLevel = { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true };
  tokenizer = {
    version: '1.0', truncation: null, padding: null,
    added_tokens: addedTokens,
    normalizer: null,
    pre_tokenizer: byteLevel,
    post_processor: { ...byteLevel, trim_offsets: false },
    decoder: byteLevel,
    model: { type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: '', end_of_word_suffix: '',
             fuse_unk: false, byte_fallback: false, ignore_merges: false,
             vocab, merges: metadata['tokenizer.ggml.merges'] },
  };
} else {
  throw new Error(`${ggufPath}: tokenizer model "${kind}" is not converted here`);
}
writeFileSync(outputPath, JSON.stringify(tokenizer));
