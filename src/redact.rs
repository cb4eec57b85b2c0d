//! The one rule for showing connection strings: every place one can appear
//! (logs, errors, `check`, `status`, the benchmark's report, `--help`) shows
//! it through [`uri`], so no place masks less than another.
//!
//! A connection string may hold a password (`user:pass@`), a token or nkey
//! written as the user (`nats://TOKEN@host`), several URLs with credentials
//! on any of them (`nats://a:1@h1,nats://b:2@h2`), or secret options
//! (`tlsCertificateKeyFilePassword=...`, `authMechanismProperties=
//! AWS_SESSION_TOKEN:...`). All of them are masked; hosts, ports, user
//! names and harmless options are kept, since they are what an operator
//! needs to see to find a wrong address.

/// What replaces a secret.
pub const MASK: &str = "***";

/// Query options whose values are secrets, matched without regard to case:
/// any name containing one of these.
const SECRET_OPTIONS: [&str; 5] = [
    "password",
    "token",
    "secret",
    "authmechanismproperties",
    "credential",
];

/// Shows a connection string, or a comma-separated list of them, with
/// every secret masked.
pub fn uri(text: &str) -> String {
    let starts = url_starts(text);
    if starts.is_empty() {
        // A scheme-less address (NATS takes `user:pass@host:4222`).
        return url(text);
    }
    let mut shown = text[..starts[0]].to_owned();
    for (i, &start) in starts.iter().enumerate() {
        let end = starts.get(i + 1).copied().unwrap_or(text.len());
        shown.push_str(&url(&text[start..end]));
    }
    shown
}

/// Where each URL of a list begins: at its scheme.
fn url_starts(text: &str) -> Vec<usize> {
    let mut starts = Vec::new();
    for (at, _) in text.match_indices("://") {
        let scheme_start = text[..at]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
            .map_or(0, |i| i + 1);
        if scheme_start < at {
            starts.push(scheme_start);
        }
    }
    starts
}

/// A URL's scheme with its `://`, and the rest; no scheme for an address
/// written without one.
fn split_scheme(text: &str) -> (&str, &str) {
    match text.find("://") {
        Some(at) => text.split_at(at + 3),
        None => ("", text),
    }
}

/// One URL (with whatever separator follows it), masked.
fn url(text: &str) -> String {
    let (scheme, rest) = split_scheme(text);
    let (shown, after) = match user_info(rest) {
        Some((start, at)) => {
            let shown = match rest[start..at].split_once(':') {
                Some((user, _password)) => format!("{user}:{MASK}"),
                // A user part without a password is a token or an nkey.
                None => MASK.to_owned(),
            };
            (format!("{}{shown}", &rest[..start]), &rest[at..])
        }
        None => (String::new(), rest),
    };
    let host_end = after.find(['/', '?', '#']).unwrap_or(after.len());
    let (host, tail) = after.split_at(host_end);
    format!("{scheme}{shown}{host}{}", options(tail))
}

/// Where the user info of `rest` (a URL after its scheme) begins and ends.
///
/// A password may hold characters that should have been percent-encoded
/// (`/`, `?`, `#`, `@`), and a query may hold an `@`; when in doubt this
/// masks too much rather than too little. The user info ends at the last
/// `@`. It starts at the beginning if no `/` comes before that `@`, or if a
/// `:` comes before the first `/` (a password with a `/`); otherwise the
/// `@` is in a path or query, unless the last path segment before it reads
/// like user info (`mongodb//u:p@h`, a typo).
fn user_info(rest: &str) -> Option<(usize, usize)> {
    let at = rest.rfind('@')?;
    let before = &rest[..at];
    match (before.find(':'), before.find('/')) {
        (_, None) => Some((0, at)),
        (Some(colon), Some(slash)) if colon < slash => Some((0, at)),
        (_, Some(_)) => {
            let start = before.rfind('/').map_or(0, |i| i + 1);
            let segment = &before[start..];
            (!segment.contains(['?', '=', '&', '#'])).then_some((start, at))
        }
    }
}

/// A URL without its user info, for a client that takes credentials
/// apart from the address and might log the address.
pub fn without_user_info(url: &str) -> String {
    let (scheme, rest) = split_scheme(url);
    match user_info(rest) {
        Some((start, at)) => format!("{scheme}{}{}", &rest[..start], &rest[at + 1..]),
        None => url.to_owned(),
    }
}

/// Masks every word of a message that reads like a connection string or
/// an address with user info, leaving the rest of the message as it is.
pub fn text(message: &str) -> String {
    let mut shown = String::with_capacity(message.len());
    let mut word = String::new();
    for c in message.chars() {
        if c.is_whitespace() || matches!(c, '"' | '\'' | '`') {
            shown.push_str(&masked_word(&word));
            word.clear();
            shown.push(c);
        } else {
            word.push(c);
        }
    }
    shown.push_str(&masked_word(&word));
    shown
}

fn masked_word(word: &str) -> String {
    if word.contains("://") || word.contains('@') {
        uri(word)
    } else {
        word.to_owned()
    }
}

/// The path and query of a URL, with secret options' values masked.
fn options(tail: &str) -> String {
    let Some(query_start) = tail.find('?') else {
        return tail.to_owned();
    };
    let (path, query) = tail.split_at(query_start + 1);
    let masked: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, value)) if is_secret(name) && !value.is_empty() => {
                format!("{name}={MASK}")
            }
            _ => pair.to_owned(),
        })
        .collect();
    format!("{path}{}", masked.join("&"))
}

fn is_secret(option: &str) -> bool {
    let option = option.to_ascii_lowercase();
    SECRET_OPTIONS.iter().any(|secret| option.contains(secret))
}

#[cfg(test)]
mod tests {
    use super::{text, uri};

    #[test]
    fn masks_passwords_tokens_and_secret_options_only() {
        let cases = [
            (
                "mongodb://app:s3cret@db1:27017,db2/?replicaSet=rs0",
                "mongodb://app:***@db1:27017,db2/?replicaSet=rs0",
            ),
            ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
            ("mongodb://h/?authSource=a@b", "mongodb://h/?authSource=a@b"),
            ("nats://T0KEN@host:4222", "nats://***@host:4222"),
            (
                "nats://a:one@h1:4222,nats://b:two@h2:4222, tls://T0KEN@h3",
                "nats://a:***@h1:4222,nats://b:***@h2:4222, tls://***@h3",
            ),
            (
                "mongodb://h/?tls=true&tlsCertificateKeyFilePassword=pw&w=1",
                "mongodb://h/?tls=true&tlsCertificateKeyFilePassword=***&w=1",
            ),
            (
                "mongodb+srv://h/?authMechanism=MONGODB-AWS&authMechanismProperties=AWS_SESSION_TOKEN:tok",
                "mongodb+srv://h/?authMechanism=MONGODB-AWS&authMechanismProperties=***",
            ),
            ("u:s3cret@127.0.0.1:4222", "u:***@127.0.0.1:4222"),
            ("mongodb//app:s3cret@h", "mongodb//app:***@h"),
            ("mongodb://app:Pa?ss#w0rd@h:1/?w=1", "mongodb://app:***@h:1/?w=1"),
            ("mongodb://app:Pa/ss@h:1/db", "mongodb://app:***@h:1/db"),
            ("nats://u:p@ss@h:4222", "nats://u:***@h:4222"),
            ("mongodb://[::1]:27017/?w=1", "mongodb://[::1]:27017/?w=1"),
        ];
        for (given, shown) in cases {
            assert_eq!(uri(given), shown, "{given}");
        }
    }

    #[test]
    fn masks_the_addresses_in_a_message_and_nothing_else() {
        assert_eq!(
            text("bad value \"mongodb://u:pw@h/\" at line 1, near ops@corp"),
            "bad value \"mongodb://u:***@h/\" at line 1, near ***@corp"
        );
        assert_eq!(text("no address here: 5s"), "no address here: 5s");
    }
}
