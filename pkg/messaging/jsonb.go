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
//
// And, when it takes b, printed bounds the length of the text jsonb gives it back as, without
// the spaces it adds after each ',' and ':' (the relay's publisher drops them again): b
// without its white space, each number written out in full as numeric prints it (1e131071 as
// 131,072 digits, from 8 bytes), and each string as given, which jsonb prints as long or
// shorter ("\u00e9" as "é"): exact for strings with no escapes but \" \\ \b \f \n \r \t.
func jsonbRefusal(b []byte) (why string, printed int64) {
	if !utf8.Valid(b) {
		return "invalid UTF-8", 0
	}
	printed = int64(len(b))
	for i := 0; i < len(b); {
		switch c := b[i]; {
		case c == '"':
			n, why := scanJSONString(b[i:])
			if why != "" {
				return why, 0
			}
			i += n
		case c == '-' || '0' <= c && c <= '9':
			n, text, ok := scanJSONNumber(b[i:])
			if !ok {
				return "the number " + truncate(string(b[i:i+n])) + ", beyond PostgreSQL's numeric range", 0
			}
			printed += int64(text - n)
			i += n
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			printed-- // jsonb keeps no white space of its own
			i++
		default:
			i++
		}
	}
	return "", printed
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

// scanJSONNumber reads the number b starts with and returns its length; whether numeric can
// hold it: its highest digit at most 10^131071, its lowest at least 10^-16383 (trailing zeros
// count, and a zero's too: jsonb keeps the scale as written), and an exponent below 2^30-1
// either way, which PostgreSQL's parser requires even of a zero; and, if it can, the length of
// numeric's text of it, what jsonb gives back.
func scanJSONNumber(b []byte) (n, text int, ok bool) {
	i := 0
	negative := b[i] == '-'
	if negative {
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
			return i, 0, false
		}
		exp *= sign
	}
	// numeric keeps the scale as written: the digits after the point, less the exponent.
	scale := len(fracDigits) - exp
	if scale > -jsonbLowestDigit {
		return i, 0, false
	}
	high, zero := 0, true // the power of ten of the highest digit not 0
	for k, d := range intDigits {
		if d != '0' {
			high, zero = len(intDigits)-1-k+exp, false
			break
		}
	}
	for k := 0; zero && k < len(fracDigits); k++ {
		if fracDigits[k] != '0' {
			high, zero = -(k+1)+exp, false
		}
	}
	if high > jsonbHighestDigit {
		return i, 0, false
	}
	// numeric prints every digit from the highest down to the units, or a 0, and the scale's
	// digits after a point: 1e5 as 100000, 1.5e-7 as 0.00000015, 0e-3 as 0.000. No sign on a
	// zero, which numeric does not keep negative.
	text = max(high+1, 1)
	if scale > 0 {
		text += 1 + scale
	}
	if negative && !zero {
		text++
	}
	return i, text, true
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }
