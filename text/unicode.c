/* GPT-2's pre-tokenization, by hand over UTF-8 (text/internal.h).
 *
 * The regex 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|
 * \s+(?!\S)|\s+ tiles the text: some alternative matches at every
 * position (every character is a letter, number, space or other), so a
 * scan from the start takes one match after another. At a position:
 *   1. an apostrophe followed by s, t, re, ve, m, ll or d (lower case
 *      only) is a contraction;
 *   2. a space (U+0020) followed by a letter, number or other character
 *      joins the run of that class that follows it;
 *   3. a letter, number or other character starts a run of its class;
 *   4. a whitespace character starts a whitespace run: all of it when the
 *      run ends the text; else, since \s+(?!\S) backtracks one character
 *      to leave the last whitespace before a non-space, all but the last
 *      character when the run has two or more, and the single character
 *      (the plain \s+) when it has one.
 * The classes come from the JavaScript engine the reference encoder runs
 * on (tools/gen_unicode_classes.js). */
#include "text/internal.h"

static bool in_ranges(const uint32_t (*r)[2], size_t n, uint32_t cp)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (cp < r[mid][0]) hi = mid;
        else if (cp > r[mid][1]) lo = mid + 1;
        else return true;
    }
    return false;
}

/* ASCII classes, built from the tables on first use would need a lock:
 * ASCII is fixed, so it is written out. */
static ts__char_class ascii_class(uint8_t c)
{
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return TS__CHAR_LETTER;
    if (c >= '0' && c <= '9') return TS__CHAR_NUMBER;
    if (c == ' ' || (c >= 0x09 && c <= 0x0D)) return TS__CHAR_SPACE;
    return TS__CHAR_OTHER;
}

ts__char_class ts__char_class_of(uint32_t cp)
{
    if (cp < 0x80) return ascii_class((uint8_t)cp);
    if (in_ranges(ts__unicode_letter_ranges, ts__unicode_letter_count, cp)) return TS__CHAR_LETTER;
    if (in_ranges(ts__unicode_number_ranges, ts__unicode_number_count, cp)) return TS__CHAR_NUMBER;
    if (in_ranges(ts__unicode_space_ranges, ts__unicode_space_count, cp)) return TS__CHAR_SPACE;
    return TS__CHAR_OTHER;
}

/* Decodes one UTF-8 character at s[pos]: its code point and length, or
 * false for a byte that starts no valid sequence. */
static bool utf8_decode(const uint8_t *s, size_t len, size_t pos, uint32_t *cp_out, size_t *n_out)
{
    uint8_t c = s[pos];
    size_t n;
    uint32_t cp, min;
    if (c < 0x80) {
        *cp_out = c;
        *n_out = 1;
        return true;
    } else if ((c & 0xE0) == 0xC0) {
        n = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
        n = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
        n = 4, cp = c & 0x07, min = 0x10000;
    } else {
        return false;
    }
    if (len - pos < n) return false;
    for (size_t i = 1; i < n; i++) {
        if ((s[pos + i] & 0xC0) != 0x80) return false;
        cp = (cp << 6) | (s[pos + i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    *cp_out = cp;
    *n_out = n;
    return true;
}

ts__char_class ts__char_at(const uint8_t *s, size_t len, size_t pos, size_t *nbytes_out)
{
    if (s[pos] < 0x80) {
        *nbytes_out = 1;
        return ascii_class(s[pos]);
    }
    uint32_t cp;
    if (!utf8_decode(s, len, pos, &cp, nbytes_out)) {
        *nbytes_out = 1;
        return TS__CHAR_OTHER;
    }
    return ts__char_class_of(cp);
}

/* The end of the run of class `cls` that starts at pos. */
static size_t run_end(const uint8_t *s, size_t len, size_t pos, ts__char_class cls)
{
    while (pos < len) {
        size_t n;
        if (ts__char_at(s, len, pos, &n) != cls) break;
        pos += n;
    }
    return pos;
}

static size_t contraction(const uint8_t *s, size_t len, size_t pos)
{
    static const char *const forms[] = {"s", "t", "re", "ve", "m", "ll", "d"};
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
        size_t k = 0;
        while (forms[i][k] && pos + 1 + k < len && s[pos + 1 + k] == (uint8_t)forms[i][k]) k++;
        if (!forms[i][k]) return 1 + k;
    }
    return 0;
}

size_t ts__pretoken_end(const uint8_t *s, size_t len, size_t pos)
{
    if (s[pos] == '\'') {
        size_t k = contraction(s, len, pos);
        if (k) return pos + k;
    }
    size_t n;
    if (s[pos] == ' ' && pos + 1 < len) {
        ts__char_class next = ts__char_at(s, len, pos + 1, &n);
        if (next != TS__CHAR_SPACE) return run_end(s, len, pos + 1, next);
    }
    ts__char_class cls = ts__char_at(s, len, pos, &n);
    if (cls != TS__CHAR_SPACE) return run_end(s, len, pos, cls);
    /* a whitespace run: find its end and the start of its last character */
    size_t last = pos, end = pos + n, chars = 1;
    while (end < len) {
        size_t m;
        if (ts__char_at(s, len, end, &m) != TS__CHAR_SPACE) break;
        last = end;
        end += m;
        chars++;
    }
    if (end == len || chars == 1) return end;
    return last;
}

static bool printable(unsigned c) { return (c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE; }

uint32_t ts__byte_to_unicode(uint8_t b)
{
    if (printable(b)) return b;
    uint32_t n = 0; /* the bytes below b that are not printable */
    for (unsigned c = 0; c < b; c++) n += !printable(c);
    return 0x100 + n;
}

/* GPT-2: the 188 printable bytes in order take ids 0..187, the other 68
 * in order take 188..255. */
int32_t ts__byte_rank(uint8_t b)
{
    int32_t id = 0;
    for (unsigned c = 0; c < b; c++) id += printable(c) == printable(b);
    return printable(b) ? id : 188 + id;
}
