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

/// One URL (with whatever separator follows it), masked.
fn url(text: &str) -> String {
    let (scheme, rest) = match text.find("://") {
        Some(at) => text.split_at(at + 3),
        None => ("", text),
    };
    let query_start = rest.find(['?', '#']).unwrap_or(rest.len());
    let (address, tail) = rest.split_at(query_start);
    // The user info ends at the last '@' before the query, and begins after
    // the last '/' before it (so `mongodb//u:p@h`, a typo, is masked too).
    let address = match address.rfind('@') {
        Some(at) => {
            let start = address[..at].rfind('/').map_or(0, |i| i + 1);
            let shown = match address[start..at].split_once(':') {
                Some((user, _password)) => format!("{user}:{MASK}"),
                // A user part without a password is a token or an nkey.
                None => MASK.to_owned(),
            };
            format!("{}{shown}{}", &address[..start], &address[at..])
        }
        None => address.to_owned(),
    };
    format!("{scheme}{address}{}", options(tail))
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
    use super::uri;

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
        ];
        for (given, shown) in cases {
            assert_eq!(uri(given), shown, "{given}");
        }
    }
}
