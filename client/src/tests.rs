//! The client against one-shot fake servers on loopback ports, whose bytes the tests write by
//! hand (chunked and close-delimited streams, events split across chunks, error bodies).

use super::*;
use serde_json::json;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};

fn client(url: &str, api_key: Option<&str>, flag: &'static AtomicBool) -> Client {
    Client::new(
        url,
        Options {
            api_key: api_key.map(str::to_string),
            interrupt: flag,
            on_thread_start: None,
        },
    )
    .unwrap()
}

#[test]
fn urls() {
    let u = base_url("http://127.0.0.1:8080").unwrap();
    assert_eq!(shown(&u), "http://127.0.0.1:8080");
    assert_eq!(
        shown(&base_url("http://example.com/v1/").unwrap()),
        "http://example.com"
    );
    assert_eq!(
        shown(&base_url("localhost:9000/proxy/v1").unwrap()),
        "http://localhost:9000/proxy"
    );
    assert_eq!(
        shown(&base_url("http://[::1]:8080/").unwrap()),
        "http://[::1]:8080"
    );
    assert_eq!(
        shown(&base_url("https://api.example.com/v1?x=1").unwrap()),
        "https://api.example.com"
    );
    let e = base_url("ftp://x").unwrap_err().to_string();
    assert!(e.contains("only http:// and https://"), "{e}");
    assert!(base_url("http://host:notaport").is_err());
    assert!(base_url("http://:80").is_err());
    let e = base_url("http://u:p@host").unwrap_err().to_string();
    assert!(e.contains("--api-key"), "{e}");
}

#[test]
fn footers() {
    let t0 = Instant::now();
    let mut a = Answer {
        usage: Some(Usage {
            completion_tokens: 11,
            prompt_tokens_details: Some(PromptDetails { cached_tokens: 42 }),
        }),
        finish: Some("stop".into()),
        first: Some(t0),
        last: Some(t0 + Duration::from_secs(2)),
        ..Answer::default()
    };
    assert_eq!(
        a.footer(),
        "[11 tokens, 5.0 tok/s, 42 cached prompt tokens, finish: stop]"
    );
    a.usage = None;
    a.pieces = 3;
    a.interrupted = true;
    assert_eq!(
        a.footer(),
        "[~3 tokens, 1.0 tok/s, ? cached prompt tokens, finish: interrupted]"
    );
    let one = Answer {
        usage: Some(Usage {
            completion_tokens: 1,
            prompt_tokens_details: None,
        }),
        finish: Some("length".into()),
        ..Answer::default()
    };
    assert_eq!(
        one.footer(),
        "[1 token, – tok/s, 0 cached prompt tokens, finish: length]"
    );
}

/// A one-shot HTTP server on a loopback port: reads one request, then runs `respond`.
fn fake_server(
    respond: impl FnOnce(TcpStream, String) + Send + 'static,
) -> (String, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let handle = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut req = Vec::new();
        let mut tmp = [0u8; 4096];
        // Head, then Content-Length bytes of body.
        let (head_end, len) = loop {
            let n = s.read(&mut tmp).unwrap();
            req.extend_from_slice(&tmp[..n]);
            if let Some(i) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&req[..i]).to_ascii_lowercase();
                let len = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse::<usize>().unwrap());
                break (i + 4, len);
            }
        };
        while req.len() < head_end + len {
            let n = s.read(&mut tmp).unwrap();
            req.extend_from_slice(&tmp[..n]);
        }
        respond(s, String::from_utf8_lossy(&req).into_owned());
    });
    (url, handle)
}

fn chunk(s: &mut TcpStream, data: &str) {
    s.write_all(format!("{:x}\r\n{data}\r\n", data.len()).as_bytes())
        .unwrap();
    s.flush().unwrap();
}

fn sse_chunk(content: &str) -> String {
    format!(
        "data: {}\n\n",
        json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": null}]})
    )
}

#[test]
fn streams_a_chunked_sse_answer() {
    static FLAG: AtomicBool = AtomicBool::new(false);
    let (url, server) = fake_server(|mut s, req| {
        assert!(
            req.starts_with("POST /v1/chat/completions HTTP/1.1\r\n"),
            "{req}"
        );
        let lower = req.to_ascii_lowercase();
        assert!(
            lower.contains("\r\nauthorization: bearer sekrit\r\n"),
            "{req}"
        );
        assert!(lower.contains("\r\naccept: text/event-stream\r\n"), "{req}");
        let body: Value = serde_json::from_str(req.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert_eq!(body["stream_options"]["include_usage"], json!(true));
        s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            .unwrap();
        chunk(&mut s, &sse_chunk(""));
        chunk(&mut s, ":\n\n");
        // An event split across chunks (inside a multi-byte character, too), and two events
        // in one.
        let hello = sse_chunk("Hel");
        chunk(&mut s, &hello[..10]);
        chunk(&mut s, &hello[10..]);
        let both = sse_chunk("lo") + &sse_chunk(" wörld");
        let cut = both.find('ö').unwrap() + 1;
        s.write_all(format!("{:x}\r\n", cut).as_bytes()).unwrap();
        s.write_all(&both.as_bytes()[..cut]).unwrap();
        s.write_all(b"\r\n").unwrap();
        let rest = &both.as_bytes()[cut..];
        s.write_all(format!("{:x}\r\n", rest.len()).as_bytes())
            .unwrap();
        s.write_all(rest).unwrap();
        s.write_all(b"\r\n").unwrap();
        let fin = json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
        chunk(&mut s, &format!("data: {fin}\r\n\r\n"));
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 7}}});
        chunk(&mut s, &format!("data: {usage}\n\ndata: [DONE]\n\n"));
        s.write_all(b"0\r\n\r\n").unwrap();
    });
    let c = client(&url, Some("sekrit"), &FLAG);
    let mut seen = Vec::new();
    let a = c
        .stream_chat(
            &json!({"messages": [], "stream_options": {"include_usage": true}}),
            &mut |p| {
                if let Piece::Content(c) = p {
                    seen.push(c.to_string())
                }
            },
        )
        .unwrap();
    server.join().unwrap();
    assert_eq!(seen, ["Hel", "lo", " wörld"]);
    assert_eq!(a.content, "Hello wörld");
    assert_eq!(a.finish.as_deref(), Some("stop"));
    assert!(!a.interrupted);
    assert!(a.footer().starts_with("[3 tokens, "));
    assert!(a
        .footer()
        .ends_with(" tok/s, 7 cached prompt tokens, finish: stop]"));
}

#[test]
fn error_statuses_and_stream_errors_carry_the_servers_message() {
    static FLAG: AtomicBool = AtomicBool::new(false);
    let (url, server) = fake_server(|mut s, _| {
        let body = r#"{"error":{"message":"invalid API key","type":"authentication_error","param":null,"code":"invalid_api_key"}}"#;
        write!(
            s,
            "HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
    });
    let e = client(&url, None, &FLAG)
        .stream_chat(&json!({}), &mut |_| {})
        .unwrap_err();
    server.join().unwrap();
    let h = e.downcast_ref::<HttpStatusError>().expect("a status error");
    assert_eq!(h.status, 401);
    assert_eq!(h.to_string(), "401 Unauthorized: invalid API key");
    assert_eq!(h.code.as_deref(), Some("invalid_api_key"));

    // An error event in a close-delimited stream.
    let (url, server) = fake_server(|mut s, _| {
        s.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
        )
        .unwrap();
        s.write_all(sse_chunk("partial").as_bytes()).unwrap();
        s.write_all(b"data: {\"error\": {\"message\": \"engine error: boom\", \"type\": \"server_error\"}}\n\ndata: [DONE]\n\n")
            .unwrap();
    });
    let e = client(&url, None, &FLAG)
        .stream_chat(&json!({}), &mut |_| {})
        .unwrap_err();
    server.join().unwrap();
    let s = e.downcast_ref::<StreamError>().expect("a stream error");
    assert_eq!(s.0, "engine error: boom");

    // A stream that ends without a finish reason.
    let (url, server) = fake_server(|mut s, _| {
        s.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
        )
        .unwrap();
        s.write_all(sse_chunk("cut off").as_bytes()).unwrap();
    });
    let e = client(&url, None, &FLAG)
        .stream_chat(&json!({}), &mut |_| {})
        .unwrap_err();
    server.join().unwrap();
    assert!(
        e.to_string().contains("before the answer was finished"),
        "{e:#}"
    );
}

#[test]
fn models_and_a_refused_connection() {
    static FLAG: AtomicBool = AtomicBool::new(false);
    let (url, server) = fake_server(|mut s, req| {
        assert!(
            req.starts_with("GET /proxy/v1/models HTTP/1.1\r\n"),
            "{req}"
        );
        let body = r#"{"object":"list","data":[{"id":"a","object":"model"},{"id":"b"}]}"#;
        write!(
            s,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
    });
    let models = client(&format!("{url}/proxy/v1/"), None, &FLAG)
        .models()
        .unwrap();
    server.join().unwrap();
    assert_eq!(models, ["a", "b"]);

    // Bind then drop a listener: its port is (almost certainly) closed now.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let e = client(&url, None, &FLAG).models().unwrap_err();
    assert!(is_connection_refused(&e), "{e:#}");
    assert!(format!("{e:#}").contains(&url), "{e:#}");
}

#[test]
fn an_interrupt_stops_a_stream_and_keeps_what_arrived() {
    static FLAG: AtomicBool = AtomicBool::new(false);
    let (url, server) = fake_server(|mut s, _| {
        s.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            .unwrap();
        chunk(&mut s, &sse_chunk("one "));
        chunk(&mut s, &sse_chunk("two"));
        // The client sets the flag once it has seen "two"; wait for it to hang up.
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 16];
        match s.read(&mut buf) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("the client should have hung up: {other:?}"),
        }
    });
    let c = client(&url, None, &FLAG);
    let a = c
        .stream_chat(&json!({}), &mut |p| {
            if p == Piece::Content("two") {
                FLAG.store(true, Ordering::SeqCst);
            }
        })
        .unwrap();
    // Dropping the client closes its connections.
    drop(c);
    server.join().unwrap();
    assert!(a.interrupted);
    assert_eq!(a.content, "one two");
    assert!(
        a.footer().ends_with("finish: interrupted]"),
        "{}",
        a.footer()
    );
}
