// Loads the reference npm packages that scripts/setup.sh installs into <repo>/.cache/npm
// (or $KILN_NPM_CACHE), wherever the scripts are run from.
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

export const npmCache =
  process.env.KILN_NPM_CACHE ?? path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../.cache/npm');

export const requireReference = createRequire(path.join(npmCache, 'package.json'));
