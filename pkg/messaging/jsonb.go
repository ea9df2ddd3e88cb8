package messaging

import (
	"strconv"
	"unicode/utf8"
)

// numeric's range, which jsonb stores every number in: at most 131,072 digits before the
// decimal point and 16,383 after it; and the exponents its parser takes, zero's included.
const (
	jsonbHighestDigit = 131071     // the power of ten of the highest digit it holds
	jsonbLowestDigit  = -16383     // and of the lowest
	jsonbExponentOver = 1073741823 // INT_MAX/2: an exponent this large, either way, is refused
)

// jsonbRefusal says what in valid JSON b PostgreSQL's jsonb refuses, or "" if it takes it
// all: invalid UTF-8, a NUL character (\u0000), a surrogate without its pair (\ud800 alone),
// or a number beyond numeric's range (1e131072, 1e-16384, 0e1073741823). encoding/json's Valid
// lets each of them through.
func jsonbRefusal(b []byte) string {
	if !utf8.Valid(b) {
		return "invalid UTF-8"
	}
	for i := 0; i < len(b); {
		switch c := b[i]; {
		case c == '"':
			n, why := scanJSONString(b[i:])
			if why != "" {
				return why
			}
			i += n
		case c == '-' || '0' <= c && c <= '9':
			n, ok := scanJSONNumber(b[i:])
			if !ok {
				return "the number " + truncate(string(b[i:i+n])) + ", beyond PostgreSQL's numeric range"
			}
			i += n
		default:
			i++
		}
	}
	return ""
}

// scanJSONString reads the string b starts with and returns its length, and what jsonb refuses
// in its escapes.
func scanJSONString(b []byte) (int, string) {
	for i := 1; i < len(b); i++ {
		switch b[i] {
		case '"':
			return i + 1, ""
		case '\\':
			if b[i+1] != 'u' {
				i++
				continue
			}
			r := hex4(b[i+2:])
			switch {
			case r == 0:
				return 0, `a NUL character (\u0000)`
			case 0xDC00 <= r && r <= 0xDFFF:
				return 0, `a low surrogate without its high one (\u` + string(b[i+2:i+6]) + `)`
			case 0xD800 <= r && r <= 0xDBFF:
				if !lowSurrogateAt(b, i+6) {
					return 0, `a high surrogate without its low one (\u` + string(b[i+2:i+6]) + `)`
				}
				i += 6
			}
			i += 5
		}
	}
	return len(b), ""
}

// lowSurrogateAt reports whether a \u escape of a low surrogate (\udc00-\udfff) starts at b[i].
func lowSurrogateAt(b []byte, i int) bool {
	if len(b) < i+6 || b[i] != '\\' || b[i+1] != 'u' {
		return false
	}
	r := hex4(b[i+2:])
	return 0xDC00 <= r && r <= 0xDFFF
}

// hex4 reads the four hex digits of a \u escape.
func hex4(b []byte) int {
	v, err := strconv.ParseUint(string(b[:4]), 16, 32)
	if err != nil {
		return -1
	}
	return int(v)
}

// scanJSONNumber reads the number b starts with and returns its length, and whether numeric can
// hold it: its highest digit at most 10^131071, its lowest at least 10^-16383 (trailing zeros
// count, and a zero's too: jsonb keeps the scale as written), and an exponent below 2^30-1
// either way, which PostgreSQL's parser requires even of a zero.
func scanJSONNumber(b []byte) (int, bool) {
	i := 0
	if b[i] == '-' {
		i++
	}
	intStart := i
	for i < len(b) && isDigit(b[i]) {
		i++
	}
	intDigits := b[intStart:i]
	var fracDigits []byte
	if i < len(b) && b[i] == '.' {
		i++
		fracStart := i
		for i < len(b) && isDigit(b[i]) {
			i++
		}
		fracDigits = b[fracStart:i]
	}
	exp := 0
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		sign := 1
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			if b[i] == '-' {
				sign = -1
			}
			i++
		}
		for i < len(b) && isDigit(b[i]) {
			if exp < jsonbExponentOver { // beyond it the verdict is the same: no overflow
				exp = exp*10 + int(b[i]-'0')
			}
			i++
		}
		if exp >= jsonbExponentOver {
			return i, false
		}
		exp *= sign
	}
	if exp-len(fracDigits) < jsonbLowestDigit {
		return i, false
	}
	for k, d := range intDigits {
		if d != '0' {
			return i, len(intDigits)-1-k+exp <= jsonbHighestDigit
		}
	}
	for k, d := range fracDigits {
		if d != '0' {
			return i, -(k+1)+exp <= jsonbHighestDigit
		}
	}
	return i, true // zero
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }
