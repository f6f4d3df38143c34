#!/usr/bin/env python3
"""Writes a byte-level BPE tokenizer.json whose vocabulary has exactly N tokens, for serving a
`kiln synth` checkpoint (which has weights and a config but no tokenizer) in load benchmarks.

  python3 bench/synth_tokenizer.py DIR [--vocab N]     (N: the config's vocab_size by default)

The vocabulary is GPT-2's 256 byte symbols, then every pair of them (65,536 merges), then as many
three-symbol tokens as N needs (pair + symbol merges): every id decodes to bytes, so whatever a
random-weight model samples streams as text. Python 3 standard library only.
"""
import argparse
import json
import pathlib
import sys

from write_random_gguf import bytes_to_unicode  # GPT-2's byte-level alphabet


def build(vocab_size):
    singles = bytes_to_unicode()
    if vocab_size < len(singles):
        sys.exit(f'synth_tokenizer: a byte-level vocabulary needs at least 256 tokens, got {vocab_size}')
    vocab = {symbol: i for i, symbol in enumerate(singles)}
    merges = []

    def add(left, right):
        if len(vocab) >= vocab_size:
            return False
        vocab[left + right] = len(vocab)
        merges.append(f'{left} {right}')
        return True

    for first in singles:
        for second in singles:
            if not add(first, second):
                return vocab, merges
    for pair in [a + b for a in singles for b in singles]:
        for third in singles:
            if not add(pair, third):
                return vocab, merges
    sys.exit(f'synth_tokenizer: {vocab_size} tokens is more than this construction makes ({len(vocab)})')


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('dir', type=pathlib.Path)
    parser.add_argument('--vocab', type=int, default=0)
    args = parser.parse_args()
    vocab_size = args.vocab or json.loads((args.dir / 'config.json').read_text())['vocab_size']
    vocab, merges = build(vocab_size)
    tokenizer = {
        'version': '1.0', 'truncation': None, 'padding': None, 'added_tokens': [], 'normalizer': None,
        'pre_tokenizer': {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': True, 'use_regex': True},
        'post_processor': None,
        'decoder': {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': True, 'use_regex': True},
        'model': {'type': 'BPE', 'dropout': None, 'unk_token': None, 'continuing_subword_prefix': None,
                  'end_of_word_suffix': None, 'fuse_unk': False, 'byte_fallback': False, 'ignore_merges': False,
                  'vocab': vocab, 'merges': merges},
    }
    (args.dir / 'tokenizer.json').write_text(json.dumps(tokenizer, ensure_ascii=False))
    print(f'{args.dir / "tokenizer.json"}: {len(vocab)} tokens, {len(merges)} merges')


if __name__ == '__main__':
    main()
