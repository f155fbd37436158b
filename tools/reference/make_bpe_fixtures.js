// Encodes a varied corpus with the npm package gpt-3-encoder and writes
// [{"name", "text", "ids"}...] as JSON (see make_bpe_fixtures.sh).
// Usage: NODE_PATH=.../node_modules node make_bpe_fixtures.js OUT.json
'use strict';
const fs = require('fs');
const { encode, decode } = require('gpt-3-encoder');

const prose = [
  'The harbour master kept a ledger of every ship that came into the bay, and in the long winter',
  'evenings he would read it aloud to whoever sat nearest the stove. Most of the entries were dull:',
  'a schooner out of Halifax with salt cod, a brig from Lisbon with wine and cork, a steamer that',
  'had lost its rudder somewhere off the Grand Banks and limped in under a jury rig. But some of',
  'them were not dull at all. In March of 1887, for instance, a three-masted barque named the',
  'Persephone had arrived with no crew aboard but a cat, a parrot that swore in Portuguese, and a',
  "captain's log whose last page was torn out. Nobody ever learned what happened to her men.\n\n",
  'He told that story more often than any other, and each time he told it a little differently.',
  "Sometimes the cat was black; sometimes it was ginger. Sometimes the parrot said nothing at all,",
  "and sometimes it recited the whole of the Lord's Prayer before breaking into oaths that made the",
  "fishermen's wives cover their children's ears. \"It doesn't matter,\" he'd say when someone",
  "pointed out the changes. \"What matters is that she came in, and that she came in empty, and",
  "that we'll never know why.\"\n\n",
  'The town itself had grown up around the harbour the way moss grows around a stone: slowly, and',
  'without any plan that anyone could later discover. There were three churches, two taverns, a',
  'chandlery, a school with forty-two pupils, and a customs house that had been built in 1851 and',
  'rebuilt in 1903 after a fire that started, depending on who you asked, in the bakery next door',
  'or in the customs officer\'s own pipe. The population, according to the census of 1911, was',
  '2,314 souls; according to the harbour master, it was "about the same as it ever was, give or',
  'take a few drowned."\n\n',
  'In the spring the ice went out of the bay with a noise like cannon fire, and the boats that had',
  'been hauled up on the shingle all winter were scraped, caulked, painted and launched again. The',
  'children were let out of school to watch. They stood along the sea wall in a ragged line -- the',
  'smallest ones held by the collar -- and cheered each hull as it slid down the ways. It was, the',
  'schoolmistress said, an education of its own: in patience, in craft, and in the plain fact that',
  "things which are looked after will last, and things which aren't, won't.\n",
].join(' ');

const cases = [
  ['empty', ''],
  ['hello', 'Hello world'],
  ['prose', prose],
  ['contractions_lower', "it's isn't they're we've I'm you'll he'd"],
  ['contractions_upper', "IT'S ISN'T THEY'RE WE'VE I'M YOU'LL HE'D"],
  ['contractions_mixed', "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'VE 'M 'LL 'D ''s '''t x's"],
  ['apostrophes', "rock 'n' roll, o'clock, ma'am, y'all'd've, '90s"],
  ['spaces_runs', 'a  b   c    d     e'],
  ['spaces_trailing', 'trailing spaces   '],
  ['spaces_leading', '   leading spaces'],
  ['only_spaces', '      '],
  ['tabs', 'col1\tcol2\t\tcol3\t \t end\t'],
  ['newlines', 'line one\nline two\n\nline four\n\n\n  indented\r\nwindows\r\n'],
  ['mixed_ws', ' \t\n \u00a0x\u3000y\u2003 z \u2028w\u000b\u000cv'],
  ['digits', '0 1 12 123 1234 12345 3.14159 2024-05-20 1,000,000 007'],
  ['long_number', '31415926535897932384626433832795028841971693993751058209749445923078164062862089986280348253421170679'],
  ['numbers_unicode', '\u0661\u0662\u0663 \u2167 \u00bd \u00b2 \u0967\u0968 \uff11\uff12'],
  ['punct', 'Wait... what?! (yes) [no] {maybe} <tag/> --- *** !!! ??? ;;; ::'],
  ['punct_commas', 'a,b,,c,,,d ,, ,,, ,"x", \',\' ,;,'],
  ['code', 'int main(void) { return x->y[0] != 0 && *p++ == \'\\n\'; } // done'],
  ['url_email', 'https://example.com/a/b?c=1&d=2#frag user.name+tag@example.org'],
  ['accents', 'café naïve résumé Zürich Ångström façade São Paulo Dvořák'],
  ['combining', 'cafe\u0301 nai\u0308ve e\u0301\u0301 a\u030a \u0915\u093f'],
  ['cjk', '你好，世界！日本語のテキスト。한국어 텍스트입니다.'],
  ['emoji', 'I \u2764\ufe0f BPE \ud83d\ude00\ud83d\ude00 \ud83d\udc68\u200d\ud83d\udc69\u200d\ud83d\udc67 \ud83c\uddeb\ud83c\uddf7 ok\ud83d\udc4d\ud83c\udffd'],
  ['greek_cyrillic', 'Αλφάβητο και Кириллица смешанный text'],
  ['arabic_hebrew', 'مرحبا بالعالم שלום עולם'],
  ['symbols', '© ® ™ € £ ¥ § ¶ ° ± × ÷ → ← ∞ ≈ ≠ ≤ ≥ ∑ ∫ √'],
  ['control', 'a\u0001b\u007fc\u0085d \u0085 e\u001cf \u001f\u001f g\u001d\u001e'],
  ['space_class_edges', ' \u0085x !\u0085! \u00a0x !\u00a0! \u2028x .\u3000. \u200bx !\u180e!'],
  ['unicode_spaces', 'a\u2000\u2000b \u180e c\u200b d\ufeff\u202f e \u3000\u3000'],
  ['mixed_classes', 'abc123def 456ghi!@#jkl 7x8y9z a1!b2?c3.'],
  ['endoftext_literal', 'text<|endoftext|>more'],
  ['repeated', 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa ' + 'ha'.repeat(30) + ' ' + '='.repeat(50)],
];

const out = [];
for (const [name, text] of cases) {
  const ids = encode(text);
  for (const id of ids) {
    if (typeof id !== 'number') throw new Error(`${name}: encode gave a non-number id ${id}`);
  }
  if (decode(ids) !== text) throw new Error(`${name}: the package's own round trip failed`);
  out.push({ name, text, ids });
}
fs.writeFileSync(process.argv[2], JSON.stringify(out, null, 1) + '\n');
