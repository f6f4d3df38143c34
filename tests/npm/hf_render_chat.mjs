// Reference renderings of chat templates by @huggingface/jinja for kiln's chat template tests.
//   node hf_render_chat.mjs < requests.jsonl > results.jsonl
// Each input line is {"template": source, "variables": {...}}; each output line is
// {"rendered": text} or {"error": message}.
import { readFileSync } from 'node:fs';
import { requireReference } from './reference_packages.mjs';

const { Template } = requireReference('@huggingface/jinja');

const compiled = new Map();
for (const line of readFileSync(0, 'utf8').split('\n')) {
  if (line.length === 0) continue;
  const { template, variables } = JSON.parse(line);
  try {
    if (!compiled.has(template)) compiled.set(template, new Template(template));
    process.stdout.write(JSON.stringify({ rendered: compiled.get(template).render(variables) }) + '\n');
  } catch (error) {
    process.stdout.write(JSON.stringify({ error: String(error.message ?? error) }) + '\n');
  }
}
