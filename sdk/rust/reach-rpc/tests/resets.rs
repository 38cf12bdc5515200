//! h2's rapid-reset defence against ordinary cancellations: a client whose calls give up
//! before the server has taken their streams (many HEADERS + RST_STREAM(CANCEL) pairs read in
//! one go, as happens when callers hit their deadlines together under load) keeps its
//! connection, while a flood of such pairs still ends it with `GOAWAY ENHANCE_YOUR_CALM`.
//! The client writes raw HTTP/2 frames, so the whole burst arrives in one write.

use std::time::Duration;

use reach_rpc::GrpcServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// An HTTP/2 frame: 9-byte header, then `payload`.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(9 + payload.len());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// A HEADERS block (HPACK, no indexing) for a gRPC health check.
fn request_headers() -> Vec<u8> {
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme http (static table)
    let literal = |block: &mut Vec<u8>, name_index: u8, value: &str| {
        block.push(name_index); // literal without indexing, indexed name (< 15)
        block.push(value.len() as u8);
        block.extend_from_slice(value.as_bytes());
    };
    literal(&mut block, 0x04, "/grpc.health.v1.Health/Check"); // :path
    literal(&mut block, 0x01, "localhost"); // :authority
    // content-type is static entry 31: a 4-bit prefix of 15, then 16.
    block.extend_from_slice(&[0x0f, 0x10, 16]);
    block.extend_from_slice(b"application/grpc");
    block
}

/// Opens a connection, sends `pairs` HEADERS + RST_STREAM(CANCEL) pairs in one write, then a
/// PING; returns the GOAWAY error code the server sent before answering the PING, if any.
async fn burst(addr: std::net::SocketAddr, pairs: u32) -> Option<u32> {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(0x4, 0, 0, &[])); // SETTINGS
    let headers = request_headers();
    for i in 0..pairs {
        let stream = 1 + 2 * i;
        // HEADERS with END_HEADERS, then RST_STREAM(CANCEL = 8).
        out.extend(frame(0x1, 0x4, stream, &headers));
        out.extend(frame(0x3, 0, stream, &8u32.to_be_bytes()));
    }
    out.extend(frame(0x6, 0, 0, b"12345678")); // PING
    tcp.write_all(&out).await.unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            // Parse the frames read so far.
            let mut at = 0;
            while buf.len() >= at + 9 {
                let len = u32::from_be_bytes([0, buf[at], buf[at + 1], buf[at + 2]]) as usize;
                if buf.len() < at + 9 + len {
                    break;
                }
                let (kind, flags) = (buf[at + 3], buf[at + 4]);
                let payload = &buf[at + 9..at + 9 + len];
                if kind == 0x7 {
                    return Some(u32::from_be_bytes(payload[4..8].try_into().unwrap()));
                }
                if kind == 0x6 && flags & 0x1 == 1 {
                    return None;
                }
                at += 9 + len;
            }
            let n = tcp.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the server closed the connection without a GOAWAY");
            buf.extend_from_slice(&chunk[..n]);
        }
    })
    .await
    .expect("the server answered within 10 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_given_up_before_the_server_took_them_do_not_cost_the_connection() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(GrpcServer::new().serve(listener, std::future::pending()));

    // 200 callers giving up together (h2's default limit is 20).
    assert_eq!(
        burst(addr, 200).await,
        None,
        "ordinary cancellations must not end the connection"
    );
    // A flood beyond the bound is still cut off: GOAWAY ENHANCE_YOUR_CALM (0xb).
    let flood = reach_rpc::http2::MAX_PENDING_ACCEPT_RESET_STREAMS as u32 + 500;
    assert_eq!(burst(addr, flood).await, Some(0xb));
}
