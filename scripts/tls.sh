# Certificates of the secured local stack. Sourced by services.sh after lib.sh.
# shellcheck shell=bash
#
# Made once with openssl, on loopback only, under .local/tls (never in the repository):
#   ca.pem, ca.key            the local certificate authority every client trusts
#   server.pem, server.key    the broker's and PostgreSQL's certificate: CN localhost,
#                             subjectAltName IP:127.0.0.1 and DNS:localhost
#   server.p12                the same as a PKCS#12 keystore for the broker (password below)
#   ca.p12                    the CA as the broker's truststore (for client certificates)
#   client.pem, client.key    a client certificate for the TLS-only PostgreSQL user (CN = its
#                             name, which clientcert=verify-full compares with the user)
#   other-ca.pem              an authority that signed nothing here: trusting it instead of
#                             ca.pem must fail (the tests' "untrusted certificate" case)
# Delete .local/tls to make new ones (then restart the secured broker and reload PostgreSQL).

TLS_DIR="$LOCAL_DIR/tls"
TLS_STORE_PASSWORD="parsley-store"   # PKCS#12 keystore/truststore password (local only)
TLS_DAYS=3650

tls_make() {
    [ -f "$TLS_DIR/.complete" ] && return 0
    command -v openssl >/dev/null 2>&1 || apt_install openssl
    local log="$LOG_DIR/tls.log"
    say "tls: making a local CA and certificates in $TLS_DIR (log: $log)"
    rm -rf "$TLS_DIR"
    mkdir -p "$TLS_DIR"
    (
        set -e
        cd "$TLS_DIR"
        openssl req -x509 -newkey rsa:2048 -nodes -days "$TLS_DAYS" -subj "/CN=parsley local CA" \
            -keyout ca.key -out ca.pem
        openssl req -x509 -newkey rsa:2048 -nodes -days "$TLS_DAYS" -subj "/CN=parsley other CA" \
            -keyout other-ca.key -out other-ca.pem
        rm -f other-ca.key
        printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n' >server.ext
        openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr
        openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days "$TLS_DAYS" \
            -extfile server.ext -out server.pem
        printf 'extendedKeyUsage=clientAuth\n' >client.ext
        openssl req -newkey rsa:2048 -nodes -subj "/CN=$PG_TLS_USER" -keyout client.key -out client.csr
        openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days "$TLS_DAYS" \
            -extfile client.ext -out client.pem
        openssl pkcs12 -export -in server.pem -inkey server.key -certfile ca.pem -name server \
            -passout "pass:$TLS_STORE_PASSWORD" -out server.p12
        rm -f server.csr client.csr server.ext client.ext ca.srl
        chmod 0644 ./*.pem
        chmod 0600 ./*.key ./*.p12
    ) >"$log" 2>&1 || fail "making the local certificates failed" "$log"
    # The truststore: the CA alone, as a PKCS#12 trusted-certificate entry (keytool writes
    # one Java reads without a private key; openssl's would need one).
    keytool -importcert -noprompt -alias parsley-ca -file "$TLS_DIR/ca.pem" -storetype PKCS12 \
        -keystore "$TLS_DIR/ca.p12" -storepass "$TLS_STORE_PASSWORD" >>"$log" 2>&1 ||
        fail "keytool could not write the broker's truststore" "$log"
    chmod 0600 "$TLS_DIR/ca.p12"
    touch "$TLS_DIR/.complete"
}
