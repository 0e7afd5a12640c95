package pipelinesport

// Inbound checks: auth (§2.3 step 1) and ping (§2.3 step 3).

import (
	"crypto/sha256"
	"crypto/subtle"
	"net/http"
	"strings"
)

// constantTimeEqual compares two strings in constant time whatever their
// lengths: both are hashed, then the digests compared (§2.3 auth-constant-time).
func constantTimeEqual(a, b string) bool {
	x, y := sha256.Sum256([]byte(a)), sha256.Sum256([]byte(b))
	return subtle.ConstantTimeCompare(x[:], y[:]) == 1
}

// CheckCredential reports whether the request carries the expected agent
// token, compared in constant time. With headerName "Authorization" the header
// must read "Bearer <expected>" (the scheme in any case, §7.1 kit-bearer-case);
// a custom header (e.g. X-API-Key) carries the raw value. The value is trimmed
// of surrounding whitespace, an auth header sent twice never matches, and an
// empty expected token never matches.
func CheckCredential(headers http.Header, expected, headerName string) bool {
	if expected == "" {
		return false
	}
	values := headerValues(headers, headerName)
	if len(values) != 1 {
		return false
	}
	received := strings.TrimSpace(values[0])
	if strings.EqualFold(headerName, "Authorization") {
		scheme, rest, _ := strings.Cut(received, " ")
		received = strings.TrimSpace(rest)
		if !strings.EqualFold(scheme, "bearer") {
			constantTimeEqual("", expected) // a wrong scheme costs the time of a wrong token
			return false
		}
	}
	return constantTimeEqual(received, expected)
}

// IsPing reports whether a decoded body is exactly {"ping": true}: one key,
// the boolean true (§2.3 ping-exact, ping-strict).
func IsPing(body any) bool {
	object, ok := body.(map[string]any)
	if !ok || len(object) != 1 {
		return false
	}
	ping, ok := object["ping"].(bool)
	return ok && ping
}
